//! Where a connection is in its life ([`ConnState`]), and what that means
//! for a request a handler stages on it.

use crate::error::Error;
use crate::reactor::SendError;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum ConnState {
    /// Waiting for the peer's first credit update.
    Connecting,
    Established,
    /// A direct connection, open: its handler posts on the QP, and the
    /// reactor's staging refuses it.
    Direct,
    /// A completion failed or posting failed; the handler was told.
    Failed,
    /// The session was removed: nothing is owned any more.
    Removed,
}

impl ConnState {
    /// True once failed or removed: nothing more is posted.
    #[inline]
    pub(crate) fn is_closed(self) -> bool {
        matches!(self, Self::Failed | Self::Removed)
    }

    /// Why a connection in this state refuses a request a handler stages
    /// (an established one refuses only for want of room).
    #[cold]
    pub(crate) fn refusal(self) -> SendError {
        match self {
            Self::Connecting | Self::Established => SendError::WouldBlock,
            Self::Failed | Self::Removed => SendError::Closed,
            Self::Direct => SendError::Invalid(Error::InvalidArgument(
                "a direct connection is posted on through Ctx::direct",
            )),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_a_failed_or_removed_connection_is_closed() {
        use ConnState::*;
        for (state, closed) in [
            (Connecting, false),
            (Established, false),
            (Direct, false),
            (Failed, true),
            (Removed, true),
        ] {
            assert_eq!(state.is_closed(), closed, "{state:?}");
        }
    }

    #[test]
    fn a_request_is_refused_as_the_state_says() {
        assert!(matches!(
            ConnState::Connecting.refusal(),
            SendError::WouldBlock
        ));
        assert!(matches!(ConnState::Failed.refusal(), SendError::Closed));
        assert!(matches!(ConnState::Removed.refusal(), SendError::Closed));
        assert!(matches!(ConnState::Direct.refusal(), SendError::Invalid(_)));
    }
}
