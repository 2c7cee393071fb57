//! A datagram endpoint's send side ([`Sends`]): registered send slots the
//! payloads are copied into, the window of sends in flight, and the list
//! a pass's datagrams go out in (one doorbell).

use crate::verbs::{
    AccessFlags, MemoryRegion, ProtectionDomain, Sge, UdDestination, UdQueuePair, UdSendList,
};

use super::super::SendError;
use super::super::conn::Ring;
use super::super::table::wr_id;
use super::window::SendWindow;

/// Most datagrams one `ibv_post_send` takes; a pass that stages more
/// rings the doorbell when the list is full.
const MAX_LIST: usize = 32;

/// The send side of a datagram endpoint.
pub(crate) struct Sends {
    endpoint: u32,
    window: SendWindow,
    ring: Ring,
    /// Slots in the ring: the depth rounded up to a power of two.
    slots: u32,
    slot_size: usize,
    /// Payloads up to this many bytes go inline.
    max_inline: u32,
    list: UdSendList<MAX_LIST>,
    /// The slots. The endpoint declares its QP first, so the QP is
    /// destroyed before this is deregistered.
    region: MemoryRegion,
}

impl Sends {
    /// `depth` sends (at least 2) of up to `max_datagram` bytes for
    /// endpoint `endpoint`, registered on `pd`.
    pub(crate) fn new(
        pd: &ProtectionDomain,
        endpoint: u32,
        depth: u32,
        max_datagram: u32,
        max_inline: u32,
    ) -> crate::Result<Self> {
        let slots = depth.next_power_of_two();
        let slot_size = max_datagram as usize;
        let region = pd.alloc_mr(slot_size * slots as usize, AccessFlags::LOCAL_WRITE)?;
        Ok(Self {
            endpoint,
            window: SendWindow::new(depth),
            ring: Ring::of(&region),
            slots,
            slot_size,
            max_inline,
            list: UdSendList::new(),
            region,
        })
    }

    /// Bytes registered for the slots.
    pub(crate) fn registered_bytes(&self) -> usize {
        self.region.len()
    }

    /// Stages `data` to `to`, a destination `qp` may send to: its bytes
    /// are copied into the next send slot. Returns whether the list is
    /// full now (the caller posts it on `qp` before staging more).
    #[inline]
    pub(crate) fn stage(
        &mut self,
        qp: &UdQueuePair,
        to: &UdDestination,
        data: &[u8],
    ) -> Result<bool, SendError> {
        qp.check_destination(to).map_err(SendError::Invalid)?;
        if data.len() > self.slot_size {
            return Err(SendError::too_large(data.len(), self.slot_size));
        }
        // A full list is posted before the next stage; were it not, no
        // number may be taken for a datagram the list cannot hold.
        if self.list.is_full() {
            return Err(SendError::WouldBlock);
        }
        let Some((seq, signaled)) = self.window.take() else {
            return Err(SendError::WouldBlock);
        };
        let slot = SendWindow::slot(seq, self.slots);
        let ptr = self.ring.slot_ptr(slot, self.slot_size);
        // SAFETY: the slot lies in the region held here (`slot < slots`,
        // `data.len() <= slot_size`), and the window gave its number out
        // only once the send that used it before retired, so the device no
        // longer reads it; `data` is the caller's, never this ring.
        unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), ptr, data.len()) };
        let local = Sge {
            addr: self.ring.slot_addr(slot, self.slot_size),
            len: data.len() as u32,
            lkey: self.region.lkey(),
        };
        let inline = data.len() as u32 <= self.max_inline;
        let wr_id = wr_id::datagram_send(self.endpoint, seq);
        // SAFETY: `local` is the slot just filled, in the region held here,
        // at most `slot_size` (the MTU) long; the window gives the slot out
        // again only once this send retired, so it stays unwritten until
        // then; `to` was checked against `qp` above, and the list is posted
        // on `qp` only (`flush`). It has room (checked above).
        let _ = unsafe { self.list.push(wr_id, local, to, inline, signaled) };
        Ok(self.list.is_full())
    }

    /// Whether datagrams wait for the doorbell.
    #[inline]
    pub(crate) fn has_staged(&self) -> bool {
        self.list.len() != 0
    }

    /// Posts the staged datagrams with one `ibv_post_send`; returns how
    /// many it posted.
    ///
    /// # Safety
    ///
    /// `qp` is the QP the datagrams were staged for ([`stage`](Self::stage)
    /// checked their destinations against it), created on the PD the slots
    /// are registered on, and destroyed before the slots are dropped.
    #[inline]
    pub(crate) unsafe fn flush(&mut self, qp: &mut UdQueuePair) -> crate::Result<usize> {
        let staged = self.list.len();
        qp.post_list(&mut self.list)?;
        Ok(staged)
    }

    /// Forgets the staged datagrams (the endpoint failed: they never go).
    pub(crate) fn drop_staged(&mut self) {
        self.list.clear();
    }

    /// Signaled send `seq` completed; false if it was not in flight.
    #[inline]
    pub(crate) fn retire(&mut self, seq: u32) -> bool {
        self.window.retire(seq)
    }
}
