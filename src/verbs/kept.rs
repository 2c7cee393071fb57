//! Requests kept together with the registrations their bytes are in, so a
//! handler can build them once and keep them for as long as it likes:
//! perftest's prebuilt requests, as values with no lifetime. A
//! [`WorkRequest`] borrows its memory for as long as it exists, which a
//! request kept in the same struct as its
//! [`MemoryRegion`](super::MemoryRegion) cannot do.

use crate::error::{Error, Result};

use super::mr::Registration;
use super::requests::sealed::{Keep, Request, Requests, Seal};
use super::wr::{Batch, RecvRequest, SendFlags, WorkRequest};

/// A [`WorkRequest`], a [`RecvRequest`] or a [`Batch`] of either, together
/// with (handles on) the registrations its bytes are in, posted again and
/// again like any other ([`QueuePair::post_send`], [`QueuePair::post_recv`]).
/// Only ids and flags change after it is built; the requests themselves
/// are never handed out, so they cannot outlive the registrations they
/// point into.
///
/// ```no_run
/// # use rdma_comm_core::verbs::*;
/// # fn demo(qp: &mut QueuePair, mr: &MemoryRegion) -> rdma_comm_core::Result<()> {
/// let memory = mr.registration();
/// let mut ping = Kept::new(WorkRequest::send(0, memory.slice(0, 64)?), &[memory])?;
/// for round in 1..=1000 {
///     ping.set_wr_id(round);
///     ping.set_flags(if round % 64 == 0 { SendFlags::SIGNALED } else { SendFlags::empty() });
///     qp.post_send(&mut ping)?;
/// }
/// # Ok(()) }
/// ```
///
/// [`QueuePair::post_send`]: super::QueuePair::post_send
/// [`QueuePair::post_recv`]: super::QueuePair::post_recv
#[derive(Debug)]
pub struct Kept<R> {
    requests: R,
    /// One handle per distinct registration (most have one).
    _memory: Vec<Registration>,
}

// SAFETY: the requests' raw pointers (`next`, `sg_list`) are written at
// each post, from the requests' own place, and never read otherwise; the
// bytes they point at are in the registrations, which are `Send + Sync`
// and held here (`Kept::new` makes a `Kept` only of requests detached from
// their borrows, after checking their bytes lie in those registrations),
// so moving it to another thread moves nothing it relies on.
unsafe impl<R: Requests + 'static> Send for Kept<R> {}

/// Checks that `sge` lies in one of `memory`: its key, and its bytes in range.
fn within(memory: &[&Registration], (addr, len, lkey): (u64, u32, u32)) -> Result<()> {
    let fits = |m: &&Registration| {
        let start = m.addr();
        let end = start + m.len() as u64;
        lkey == m.lkey()
            && addr >= start
            && addr.checked_add(u64::from(len)).is_some_and(|e| e <= end)
    };
    if len > 0 && !memory.iter().any(fits) {
        return Err(Error::InvalidArgument(
            "a kept request's bytes must lie in a registration it keeps",
        ));
    }
    Ok(())
}

impl<R: Requests> Kept<R> {
    /// Keeps `requests` (a [`WorkRequest`], a [`RecvRequest`] or a
    /// [`Batch`] of either), whose bytes must each lie in one of `memory`
    /// (checked: the key and the range). A [`WorkRequest::send_inline`]
    /// request is refused, since its bytes are in no registration.
    pub fn new<B>(requests: B, memory: &[&Registration]) -> Result<Self>
    where
        B: Keep<Kept = R>,
    {
        let mut requests = requests;
        for request in requests.requests_mut(Seal::new()).iter() {
            within(memory, request.local_sge())?;
        }
        let requests = requests.kept().ok_or(Error::InvalidArgument(
            "an inline request's bytes are in no registration to keep",
        ))?;
        let mut kept: Vec<Registration> = Vec::with_capacity(memory.len());
        for &m in memory {
            if !kept.iter().any(|k| k.same_as(m)) {
                kept.push(m.clone());
            }
        }
        Ok(Self {
            requests,
            _memory: kept,
        })
    }
}

impl<R: Requests> Requests for Kept<R> {
    type Wr = R::Wr;
    type Request = R::Request;

    #[inline(always)]
    fn requests_mut(&mut self, seal: Seal) -> &mut [R::Request] {
        self.requests.requests_mut(seal)
    }
}

impl Kept<WorkRequest<'static>> {
    /// Sets the id its next completion carries.
    #[inline]
    pub fn set_wr_id(&mut self, wr_id: u64) {
        self.requests.set_wr_id(wr_id);
    }

    /// The id its next completion carries.
    #[inline]
    pub fn wr_id(&self) -> u64 {
        self.requests.wr_id()
    }

    /// Sets its flags, as [`WorkRequest::set_flags`].
    #[inline]
    pub fn set_flags(&mut self, flags: SendFlags) {
        self.requests.set_flags(flags);
    }

    /// Its flags.
    #[inline]
    pub fn flags(&self) -> SendFlags {
        self.requests.flags()
    }
}

impl Kept<RecvRequest<'static>> {
    /// Sets the id its next completion carries.
    #[inline]
    pub fn set_wr_id(&mut self, wr_id: u64) {
        self.requests.set_wr_id(wr_id);
    }

    /// The id its next completion carries.
    #[inline]
    pub fn wr_id(&self) -> u64 {
        self.requests.wr_id()
    }
}

impl<R: Request, const N: usize> Kept<Batch<R, N>> {
    /// Requests in the batch.
    #[inline]
    pub fn len(&self) -> usize {
        self.requests.len()
    }

    /// True with no requests.
    #[inline]
    pub fn is_empty(&self) -> bool {
        self.requests.is_empty()
    }

    /// Sets the id of request `index` (nothing past the end).
    #[inline]
    pub fn set_wr_id(&mut self, index: usize, wr_id: u64) {
        if let Some(request) = self.requests.requests_mut(Seal::new()).get_mut(index) {
            request.set_wr_id(wr_id);
        }
    }

    /// The id of request `index`.
    #[inline]
    pub fn wr_id(&self, index: usize) -> Option<u64> {
        self.requests.requests.get(index).map(R::wr_id)
    }

    /// After a post of this batch that took only some of it
    /// ([`Error::Post`](crate::Error::Post)): drops those, so that posting
    /// the batch again posts the rest and no buffer twice. Any other
    /// outcome leaves the batch whole, to post again as it is. The batch
    /// stays without the dropped requests (keep a new one for the whole
    /// list); the registrations stay kept.
    #[inline]
    pub fn drop_posted(&mut self, outcome: &crate::error::Result<()>) {
        if matches!(outcome, Err(crate::Error::Post { .. })) {
            self.requests.drop_posted(outcome);
        }
    }
}

impl<const N: usize> Kept<Batch<WorkRequest<'static>, N>> {
    /// Sets the flags of request `index`, as [`WorkRequest::set_flags`]
    /// (nothing past the end).
    #[inline]
    pub fn set_flags(&mut self, index: usize, flags: SendFlags) {
        if let Some(request) = self.requests.get_mut(index) {
            request.set_flags(flags);
        }
    }

    /// The flags of request `index`.
    #[inline]
    pub fn flags(&self, index: usize) -> Option<SendFlags> {
        self.requests.requests.get(index).map(WorkRequest::flags)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::verbs::{AccessFlags, Context, SendBatch};

    fn context() -> Context {
        // SAFETY: nothing is posted and no registered byte is touched.
        unsafe { Context::loopback() }
    }

    #[test]
    fn keeps_only_requests_whose_bytes_lie_in_its_memory() {
        let ctx = context();
        let pd = ctx.alloc_pd().unwrap();
        let one = pd.alloc_mr(64, AccessFlags::LOCAL_WRITE).unwrap();
        let other = pd.alloc_mr(64, AccessFlags::LOCAL_WRITE).unwrap();
        let (one, other) = (one.registration(), other.registration());

        let send = WorkRequest::send(1, one.slice(0, 8).unwrap());
        assert!(Kept::new(send, &[other]).is_err());
        assert!(Kept::new(send, &[other, one]).is_ok());
        assert!(Kept::new(WorkRequest::send_inline(2, b"x"), &[one]).is_err());
        let empty = WorkRequest::send(3, one.slice(0, 0).unwrap());
        assert!(Kept::new(empty, &[]).is_ok(), "no bytes, no memory needed");

        let batch = || {
            let mut batch = SendBatch::<4>::new();
            batch.push(send).unwrap();
            batch
                .push(WorkRequest::send(4, other.slice(8, 8).unwrap()))
                .unwrap();
            batch
        };
        assert!(
            Kept::new(batch(), &[one]).is_err(),
            "one request is elsewhere"
        );
        let mut kept = Kept::new(batch(), &[one, other, one]).unwrap();
        assert_eq!(kept._memory.len(), 2, "a registration is held once");
        kept.set_wr_id(1, 40);
        kept.set_flags(1, SendFlags::SIGNALED);
        kept.set_wr_id(9, 90);
        assert_eq!(kept.wr_id(1), Some(40));
        assert_eq!(kept.flags(1), Some(SendFlags::SIGNALED));
        assert_eq!(kept.wr_id(9), None);
        assert_eq!(kept.len(), 2);
        let partial = Err(crate::Error::Post {
            verb: "ibv_post_send",
            errno: libc::ENOMEM,
            device: "test".into(),
            qpn: 1,
            posted: 1,
        });
        kept.drop_posted(&partial);
        assert_eq!(kept.wr_id(0), Some(40), "what the post took is dropped");
        assert_eq!(kept.len(), 1);
        kept.drop_posted(&Ok(()));
        assert_eq!(kept.len(), 1, "a whole post leaves it to post again");

        let recv = RecvRequest::new(5, other.slice(0, 8).unwrap()).unwrap();
        assert!(Kept::new(recv, &[one]).is_err());
        let mut recv = Kept::new(recv, &[other]).unwrap();
        recv.set_wr_id(6);
        assert_eq!(recv.wr_id(), 6);
    }
}
