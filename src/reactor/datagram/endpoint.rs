//! One datagram endpoint ([`DatagramEndpoint`]): a UD QP on the reactor's CQs
//! with its receive ring and its send side.

use crate::error::Error;
use crate::verbs::{
    Gid, ProtectionDomain, SharedCq, UdConfig, UdDestination, UdQueuePair, WcStatus, WorkCompletion,
};

use super::super::SendError;
use super::receives::{Landed, Receives};
use super::sends::Sends;

/// What a vetted completion of an endpoint brings.
#[derive(Debug)]
pub(crate) enum Arrived {
    /// A datagram in receive slot `slot`.
    Datagram { slot: u32, landed: Landed },
    /// Nothing for the handler: signaled sends retired, a receive that
    /// failed on its own (its slot goes back) or one too short for a GRH,
    /// or a completion of a failed endpoint.
    Nothing,
    /// A completion that failed the endpoint (its QP is in error).
    Failed(Error),
    /// Not this endpoint's: another QP's completion naming it.
    Foreign,
    /// A completion of an endpoint removed since it posted the request.
    Stale,
}

/// A UD QP on the reactor's CQs, its receive ring and its send side.
pub(crate) struct DatagramEndpoint {
    // Declared first: destroyed before the rings are deregistered.
    qp: UdQueuePair,
    receives: Receives,
    sends: Sends,
    failed: bool,
    /// A refused post failed the endpoint: its handler is to be told.
    report: Option<Error>,
    /// Datagrams posted, and the doorbells that posted them, for the
    /// reactor's counters (read with them: nothing counts per pass).
    posted: PostCount,
}

// SAFETY: the raw pointers in the rings and lists point into this
// endpoint's own regions and arrays (the requests' links among them), or
// at address handles that `Arc`s of the send list and the QP keep alive
// and that may be used from any thread (`AddressHandle` is `Send` and
// `Sync`); moving the endpoint to another thread moves none of that.
unsafe impl Send for DatagramEndpoint {}

impl DatagramEndpoint {
    /// Creates the QP on `pd` and `cq` (for both queues), its rings on
    /// `pd`, and posts every receive. The rings' memory and the QP share
    /// the PD, and the QP, declared first, goes before the rings: what
    /// the rings' posts ask of the QP they post on.
    pub(crate) fn new(
        pd: &ProtectionDomain,
        cq: &SharedCq,
        index: u32,
        config: &UdConfig,
    ) -> crate::Result<Self> {
        if config.max_send_wr < 2 {
            return Err(Error::InvalidArgument(
                "UdConfig::max_send_wr: a datagram endpoint needs at least 2",
            ));
        }
        let qp = pd.create_ud_qp(cq, cq, config)?;
        let max = qp.max_datagram();
        let receives = Receives::new(pd, index, config.max_recv_wr, max)?;
        let sends = Sends::new(pd, index, config.max_send_wr, max, qp.max_inline_data())?;
        let mut endpoint = Self {
            qp,
            receives,
            sends,
            failed: false,
            report: None,
            posted: PostCount::default(),
        };
        // SAFETY: the endpoint's own QP, on `pd` like the ring, and declared
        // before the ring so destroyed first.
        unsafe { endpoint.receives.flush(&mut endpoint.qp)? };
        Ok(endpoint)
    }

    /// The QP: its number, what peers need to reach it, destinations.
    pub(crate) fn qp(&self) -> &UdQueuePair {
        &self.qp
    }

    /// Joins multicast group `group`.
    pub(crate) fn join(&mut self, group: Gid) -> crate::Result<()> {
        self.qp.join(group)
    }

    /// Leaves multicast group `group`.
    pub(crate) fn leave(&mut self, group: Gid) -> crate::Result<()> {
        self.qp.leave(group)
    }

    /// Bytes registered for the receive ring and the send slots.
    pub(crate) fn registered_bytes(&self) -> (usize, usize) {
        (
            self.receives.registered_bytes(),
            self.sends.registered_bytes(),
        )
    }

    /// Vets completion `wc`, which names this endpoint as a receive into
    /// slot `value` (`receive`) or as send `value`, and says what it
    /// brings.
    #[inline]
    pub(crate) fn complete(&mut self, wc: &WorkCompletion, receive: bool, value: u32) -> Arrived {
        if wc.qp_num() != self.qp.qpn() {
            return Arrived::Foreign;
        }
        if self.failed {
            return Arrived::Nothing;
        }
        if !wc.is_success() {
            return self.failed_completion(wc, receive, value);
        }
        if !receive {
            self.sends.retire(value);
            return Arrived::Nothing;
        }
        match self.receives.consume(value, wc.byte_len()) {
            Ok(landed) => Arrived::Datagram {
                slot: value,
                landed,
            },
            Err(consumed) => {
                if consumed {
                    self.receives.queue(value);
                }
                Arrived::Nothing
            }
        }
    }

    /// A failed completion: a receive that failed alone (not flushed by a
    /// QP in error: a datagram longer than the slot, say) gives its slot
    /// back and the endpoint goes on; anything else fails it.
    #[cold]
    fn failed_completion(&mut self, wc: &WorkCompletion, receive: bool, slot: u32) -> Arrived {
        if receive && wc.status() != WcStatus::WR_FLUSH_ERR {
            // Consumed (if it was posted) with no bytes to read.
            if matches!(self.receives.consume(slot, 0), Err(true)) {
                self.receives.queue(slot);
            }
            log::debug!("datagram receive failed alone, slot reposted: {wc:?}");
            return Arrived::Nothing;
        }
        self.failed = true;
        self.sends.drop_staged();
        Arrived::Failed(
            wc.ok()
                .err()
                .unwrap_or(Error::InvalidArgument("failed datagram completion")),
        )
    }

    /// Datagram slot `slot` was read: it goes back to the device. Returns
    /// whether enough wait for a repost batch.
    #[inline]
    pub(crate) fn release(&mut self, slot: u32) -> bool {
        self.receives.queue(slot);
        self.receives.is_due()
    }

    /// Stages `data` to `to`; a full list is posted at once.
    #[inline]
    pub(crate) fn stage(&mut self, to: &UdDestination, data: &[u8]) -> Result<(), SendError> {
        if self.failed {
            return Err(SendError::Closed);
        }
        if self.sends.stage(&self.qp, to, data)? {
            self.post_sends();
            if self.failed {
                return Err(SendError::Closed);
            }
        }
        Ok(())
    }

    /// Rings the doorbell for the staged datagrams. A refused post fails
    /// the endpoint.
    #[inline]
    fn post_sends(&mut self) {
        if self.failed {
            self.sends.drop_staged();
            return;
        }
        // SAFETY: the endpoint's own QP, which staged them (`stage`), on
        // the slots' PD and declared before them.
        match unsafe { self.sends.flush(&mut self.qp) } {
            Ok(posted) => {
                self.posted.requests += posted as u64;
                self.posted.doorbells += u64::from(posted != 0);
            }
            Err(error) => self.post_failed(error),
        }
    }

    /// The end of a pass: the staged datagrams' doorbell, and the receives
    /// waiting to go back if a batch is due (all of them if `idle`).
    /// Returns whether receives still wait (none do on a failed endpoint)
    /// and whether a refused post failed it with a report for its handler.
    #[inline]
    pub(crate) fn flush(&mut self, idle: bool) -> Flushed {
        if self.sends.has_staged() {
            self.post_sends();
        }
        if self.receives.is_due() || idle && self.receives.has_pending() {
            self.post_receives();
        }
        Flushed {
            pending: !self.failed && self.receives.has_pending(),
            report: self.report.is_some(),
        }
    }

    /// Datagrams posted and the doorbells that posted them, so far.
    pub(crate) fn posted(&self) -> PostCount {
        self.posted
    }

    /// The device refused a post: the endpoint is failed, and its handler
    /// is told after the pass.
    #[cold]
    fn post_failed(&mut self, error: Error) {
        if !self.failed {
            self.failed = true;
            self.report = Some(error);
        }
        self.sends.drop_staged();
    }

    /// The error of a refused post, once.
    pub(crate) fn take_report(&mut self) -> Option<Error> {
        self.report.take()
    }

    /// Posts the receives waiting to go back. A refused post fails the
    /// endpoint.
    #[inline(never)]
    fn post_receives(&mut self) {
        if self.failed {
            return;
        }
        // SAFETY: the endpoint's own QP, on the ring's PD and declared
        // before it.
        if let Err(error) = unsafe { self.receives.flush(&mut self.qp) } {
            self.post_failed(error);
        }
    }

    /// Whether receives wait to be posted again (none do on a failed
    /// endpoint).
    #[inline]
    pub(crate) fn has_pending_receives(&self) -> bool {
        !self.failed && self.receives.has_pending()
    }

    /// Whether a full batch of receives waits to be posted again.
    #[inline]
    pub(crate) fn has_due_receives(&self) -> bool {
        !self.failed && self.receives.is_due()
    }
}

/// What [`DatagramEndpoint::flush`] left.
pub(crate) struct Flushed {
    /// Receives still wait to be posted again.
    pub(crate) pending: bool,
    /// A refused post failed the endpoint: its handler is to be told.
    pub(crate) report: bool,
}

/// Datagrams posted and the doorbells that posted them.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct PostCount {
    pub(crate) requests: u64,
    pub(crate) doorbells: u64,
}
