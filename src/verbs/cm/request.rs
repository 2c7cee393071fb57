//! A peer's connect request, taken from its event: accept it with a QP
//! created on its id, or reject it.

use std::fmt;
use std::net::SocketAddr;

use arrayvec::ArrayVec;

use crate::error::Result;

use super::super::{QueuePair, UdQueuePair};
use super::{CmId, ConnParams};

/// A connect request: the new id for the connection, the peer's private
/// data and what it asked for. Dropping it unanswered destroys the id,
/// which rejects the peer; but a QP created on the id holds it, so after
/// [`CmId::create_qp`] answer with [`reject`](Self::reject) (or drop the
/// QP too).
pub struct ConnectRequest {
    pub(super) id: CmId,
    pub(super) private_data: ArrayVec<u8, { super::MAX_PRIVATE_DATA }>,
    pub(super) requested: ConnParams,
}

impl fmt::Debug for ConnectRequest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ConnectRequest")
            .field("id", &self.id)
            .field("requested", &self.requested)
            .field("private_data_len", &self.private_data.len())
            .finish()
    }
}

impl ConnectRequest {
    /// The connection's id, bound to the device the request came in on:
    /// make the QP with its [`context`](CmId::context) and
    /// [`create_qp`](CmId::create_qp) before accepting.
    pub fn id(&self) -> &CmId {
        &self.id
    }

    /// Moves the connection's id to channel `to`, where its later events
    /// (`Established`, `Disconnected`) then arrive: call it before creating
    /// the QP (see [`CmId::migrate`]).
    pub fn migrate(&mut self, to: &super::EventChannel) -> Result<()> {
        self.id.migrate(to)
    }

    /// The private data of the request (as padded by the transport: up to
    /// 56 bytes on InfiniBand and RoCE, 180 for a datagram request, zeros
    /// after what the peer sent).
    pub fn private_data(&self) -> &[u8] {
        &self.private_data
    }

    /// What the peer asked for, from our side: `responder_resources` is how
    /// many READs it wants to have outstanding at us, `initiator_depth` how
    /// many it will serve (all zeros for a datagram request).
    pub fn requested(&self) -> ConnParams {
        self.requested
    }

    /// The peer's address.
    pub fn peer_addr(&self) -> Option<SocketAddr> {
        self.id.peer_addr()
    }

    /// Accepts with `qp` (made by the request's id, see [`id`](Self::id);
    /// post its receives first) and up to 196 bytes of `private_data`: the QP goes to
    /// RTS with READ depths no deeper than the peer asked for and the QP's
    /// `max_rd_atomic`, and the peer is answered. `Established` follows
    /// on the channel once the peer confirms. On failure the QP is left in
    /// the error state and the peer is rejected.
    pub fn accept(mut self, qp: &mut QueuePair, private_data: &[u8]) -> Result<CmId> {
        if let Err(err) = self.id.accept(qp, self.requested, private_data) {
            // The QP holds the id, so dropping the request would not
            // destroy it: say no now rather than leave the peer waiting
            // for its connect timeout.
            let _ = self.id.reject(&[]);
            return Err(err);
        }
        Ok(self.id)
    }

    /// Answers a datagram request (to a listener made with
    /// [`EventChannel::create_ud_id`](super::EventChannel::create_ud_id))
    /// with `qp` (made by the request's id with
    /// [`create_ud_qp`](CmId::create_ud_qp); post its receives first) and
    /// up to 136 bytes of `private_data`: the peer learns the QP's number
    /// and Q_Key and gets its `Established` event. No event follows on this
    /// side; the peer's datagrams arrive on `qp`, and
    /// [`UdQueuePair::reply_destination`] answers each. On failure the
    /// peer is rejected.
    pub fn accept_ud(mut self, qp: &UdQueuePair, private_data: &[u8]) -> Result<CmId> {
        if let Err(err) = self.id.accept_ud(qp, private_data) {
            // The QP holds the id, so dropping the request would not
            // destroy it: say no now.
            let _ = self.id.reject(&[]);
            return Err(err);
        }
        Ok(self.id)
    }

    /// Rejects the request with up to 148 bytes of `private_data` (136 for
    /// a datagram request), which the peer gets with its `Rejected` event
    /// (`Unreachable`, with the status only, for a datagram request).
    pub fn reject(mut self, private_data: &[u8]) -> Result<()> {
        self.id.reject(private_data)
    }
}
