//! Direct connections: a handler that wants perftest's loop and none of the
//! reactor's services posts on its connection's QP itself, with requests it
//! built once (kept with their memory: [`Kept`]), and gets each
//! completion as it comes ([`Handler::on_direct_completion`]). The reactor
//! still owns the QP, polls the shared CQs, routes every completion by the
//! connection it names (index, generation and QP number, as for its own),
//! fails the connection on a failed completion, and removes it with its
//! session; it stages, signals, credits and reposts nothing. The handler
//! keeps its receives posted, its send queue within depth and its peer
//! within its receives, as on a bare QP (the peer must run direct too).
//!
//! A request's `wr_id` carries the connection in its top 32 bits, which
//! the reactor writes at each post; the low 32 bits are the handler's own
//! and come back with the completion.
//!
//! [`Handler::on_direct_completion`]: super::Handler::on_direct_completion

use std::fmt;

use crate::error::Result;
use crate::verbs::requests::sealed::{Request, Requests, Seal};
#[cfg(doc)]
use crate::verbs::{Kept, SendBatch};
use crate::verbs::{QueuePair, RecvRequests, SendRequests};

use super::conn::Conn;
use super::table::ConnTable;
use super::{ConnId, Ctx, SendError};

/// Posting on a direct connection's QP, from [`Ctx::direct`]. It borrows
/// the `Ctx`, so it lives within one callback. Each post rings its own
/// doorbell (a batch, [`SendBatch`], rings one for the batch).
pub struct DirectQp<'c> {
    pub(super) qp: &'c mut QueuePair,
    /// The top halves of the connection's send-queue and receive ids
    /// (made once, with the connection).
    pub(super) send_tag: u64,
    pub(super) recv_tag: u64,
}

impl fmt::Debug for DirectQp<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DirectQp")
            .field("qpn", &self.qp.qpn())
            .finish()
    }
}

/// `wr_id` with its top half replaced by `tag`.
#[inline(always)]
fn tagged(tag: u64, wr_id: u64) -> u64 {
    tag | (wr_id & u64::from(u32::MAX))
}

/// Replaces the top half of every request's id with `tag`.
#[inline(always)]
fn tag_all<R: Requests>(tag: u64, requests: &mut R) {
    for request in requests.requests_mut(Seal::new()) {
        request.set_wr_id(tagged(tag, request.wr_id()));
    }
}

impl DirectQp<'_> {
    /// Posts `requests` as [`QueuePair::post_send`] does, and leaves them
    /// with the caller, to post again. The low 32 bits of each request's
    /// id are the handler's; the top 32 name the connection.
    #[inline(always)]
    pub fn post_send<R: SendRequests>(&mut self, requests: &mut R) -> Result<()> {
        tag_all(self.send_tag, requests);
        self.qp.post_send(requests)
    }

    /// Posts receives as [`QueuePair::post_recv`] does (their ids' low 32
    /// bits are the handler's).
    #[inline]
    pub fn post_recv<R: RecvRequests>(&mut self, requests: &mut R) -> Result<()> {
        tag_all(self.recv_tag, requests);
        self.qp.post_recv(requests)
    }

    /// The QP's number.
    pub fn qpn(&self) -> u32 {
        self.qp.qpn()
    }

    /// The QP's send-queue depth: requests posted and not known complete
    /// (a signaled completion retires those before it) must stay within.
    pub fn max_send_wr(&self) -> u32 {
        self.qp.max_send_wr()
    }

    /// The QP's receive-queue depth.
    pub fn max_recv_wr(&self) -> u32 {
        self.qp.max_recv_wr()
    }

    /// The most bytes a request may carry inline.
    pub fn max_inline_data(&self) -> u32 {
        self.qp.max_inline_data()
    }
}

impl Ctx<'_> {
    /// Posting on `conn`'s QP, if it is a direct connection of this
    /// reactor ([`Reactor::add_direct`](super::Reactor::add_direct)) that
    /// has not failed: [`SendError::Closed`] otherwise, and
    /// [`SendError::Invalid`] for a connection of the reactor's own
    /// protocol, whose QP only the reactor posts on.
    ///
    /// As with `Ctx`'s other methods, any handler of the reactor may post
    /// on any of its connections (a relay's two sides share one reactor):
    /// a handler that posts on another session's direct connection shares
    /// that connection's queue accounting with its handler. A request whose
    /// memory is of another protection domain than the QP's fails the
    /// connection with a protection error.
    #[inline]
    pub fn direct(&mut self, conn: ConnId) -> Result<DirectQp<'_>, SendError> {
        direct_conn(self.conns, conn)?
            .direct_qp()
            .ok_or(SendError::Closed)
    }
}

/// `conn`'s record if it is a direct connection ([`SendError::Closed`] if
/// it is gone, [`SendError::Invalid`] for one of the reactor's protocol).
#[inline]
pub(super) fn direct_conn(conns: &mut ConnTable, conn: ConnId) -> Result<&mut Conn, SendError> {
    let record = conns.get_mut_quiet(conn.key()).ok_or(SendError::Closed)?;
    if !record.is_direct() {
        return Err(SendError::Invalid(crate::Error::InvalidArgument(
            "not a direct connection: the reactor alone posts on its QP",
        )));
    }
    Ok(record)
}
