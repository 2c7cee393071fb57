//! What the send queue remembers of each request ([`SqOp`]) until a
//! signaled completion at or after it proves it done.

use crate::reactor::ConnId;
use crate::reactor::slab::Key;

/// An operation on the send queue, remembered until a signaled completion
/// at or after it proves it done. Plain data of 16 bytes: staging and
/// retiring one copies two words and runs no drop glue (the registration a
/// request holds by handle, the rare case, waits in `SendQueue::owned` beside it).
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct SqOp {
    kind: OpKind,
    /// For a forward: the slot is one of the reactor's SRQ.
    from_srq: bool,
    /// For a WRITE, READ or forward: how the registration of the local
    /// memory it points at is held until the request is known complete, so
    /// the memory stays registered and mapped while the device may use it.
    keep: Keep,
    /// For a forward, the receive slot of its origin to repost.
    slot: u32,
    /// For a forward: the slab index and generation of the connection
    /// whose receive slot this SEND carried. It is of the same reactor
    /// (`Ctx::forward` refuses another's), so its owner is this
    /// connection's: storing the whole id would double the op.
    origin_index: u32,
    origin_generation: u32,
}

/// Where a forwarded message came from: its connection and receive slot,
/// which go back there once the forward completes.
#[derive(Clone, Copy, Debug)]
pub(crate) struct ForwardOrigin {
    pub(crate) conn: ConnId,
    pub(crate) slot: u32,
    /// The slot is one of the reactor's SRQ.
    pub(crate) from_srq: bool,
}

/// How a request holds the registration of its local memory.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) enum Keep {
    /// It points at the connection's own send ring (or nothing).
    #[default]
    Nothing,
    /// The registration the connection holds by count
    /// (`RegistrationCache`): the common case of one buffer region used
    /// over and over costs no atomic reference count per request.
    Cached,
    /// A handle of its own, in `SendQueue::owned` at the op's position.
    Own,
}

// Two words: the size the send-queue ring was shrunk to.
const _: () = assert!(std::mem::size_of::<SqOp>() == 16);

impl SqOp {
    pub(super) fn of(kind: OpKind) -> Self {
        Self {
            kind,
            ..Self::default()
        }
    }

    /// An op of `kind` that holds its local memory's registration as
    /// `keep` says.
    pub(super) fn holding(kind: OpKind, keep: Keep) -> Self {
        Self {
            kind,
            keep,
            ..Self::default()
        }
    }

    /// A forward of `origin`'s receive slot.
    pub(super) fn forward(origin: ForwardOrigin, keep: Keep) -> Self {
        let key = origin.conn.key();
        Self {
            kind: OpKind::Forward,
            from_srq: origin.from_srq,
            keep,
            slot: origin.slot,
            origin_index: key.index,
            origin_generation: key.generation,
        }
    }

    /// What kind of request it is.
    #[inline(always)]
    pub(crate) fn kind(&self) -> OpKind {
        self.kind
    }

    /// How it holds its local memory's registration.
    #[inline(always)]
    pub(super) fn keep(&self) -> Keep {
        self.keep
    }

    /// For a forward staged on connection `on`: the connection and receive
    /// slot it came from, to give back once it completes.
    #[inline]
    pub(crate) fn forward_origin(&self, on: ConnId) -> Option<ForwardOrigin> {
        (self.kind == OpKind::Forward).then(|| ForwardOrigin {
            conn: ConnId(Key {
                index: self.origin_index,
                generation: self.origin_generation,
                owner: on.key().owner,
            }),
            slot: self.slot,
            from_srq: self.from_srq,
        })
    }
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) enum OpKind {
    #[default]
    Credit,
    Send,
    Write,
    Read,
    /// A SEND straight out of a held receive slot of another connection.
    Forward,
}
