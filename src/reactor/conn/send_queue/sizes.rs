//! How large a connection's send side is ([`Sizes`]), from the reactor's
//! configuration and what its QP allows.

use crate::reactor::ReactorConfig;
use crate::verbs::QueuePair;

/// The fewest send-queue entries a connection works with.
pub(crate) const MIN_SQ_DEPTH: u32 = 4;

/// The sizes of a send queue. Its rings are powers of two, so positions in
/// them are masks, not divisions (a DIV on every message shows up in
/// latency, under emulation most of all), and a ring index stays
/// continuous when a sequence number wraps; the entries in use need not
/// be (providers round their queues up to a power of two, Soft-RoCE after
/// adding one, so a depth of 2^k - 1 is what costs no memory for nothing).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Sizes {
    /// Send-queue entries in use at most: the configured depth, at most
    /// the QP's room.
    pub(super) depth: u32,
    /// Positions of the ring that records them: `depth` rounded up to a
    /// power of two.
    pub(super) ring: u32,
    /// One request in this many is signaled: at most half the queue.
    pub(super) signal_interval: u32,
    /// Send slots: at least two signaling intervals, rounded up.
    pub(super) slots: u32,
}

impl Sizes {
    /// The sizes `config` asks for on `qp`.
    pub(super) fn of(config: &ReactorConfig, qp: &QueuePair) -> Self {
        Self::within(config, sq_room(config, qp))
    }

    /// The sizes `config` asks for with `room` send-queue entries.
    fn within(config: &ReactorConfig, room: u32) -> Self {
        let depth = room.max(MIN_SQ_DEPTH);
        let signal_interval = config.signal_interval.clamp(1, depth / 2);
        let slots = config
            .send_slots
            .max(2 * signal_interval)
            .next_power_of_two();
        Self {
            depth,
            ring: depth.next_power_of_two(),
            signal_interval,
            slots,
        }
    }
}

/// The send-queue entries of `qp` the reactor may use before rounding: its
/// configured depth, at most the QP's, less the entries the QP's window
/// binds hold (until a signaled completion retires them, which the reactor
/// does not track: it leaves them their entries for good).
pub(crate) fn sq_room(config: &ReactorConfig, qp: &QueuePair) -> u32 {
    config
        .sq_depth
        .min(qp.max_send_wr().saturating_sub(qp.bound_windows()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sizes(sq_depth: u32, signal_interval: u32, send_slots: u32, room: u32) -> Sizes {
        let config = ReactorConfig {
            sq_depth,
            signal_interval,
            send_slots,
            ..ReactorConfig::default()
        };
        Sizes::within(&config, room.min(sq_depth))
    }

    #[test]
    fn the_depth_is_the_rooms_and_the_rings_are_powers_of_two() {
        let exact = Sizes {
            depth: 16,
            ring: 16,
            signal_interval: 4,
            slots: 8,
        };
        assert_eq!(sizes(16, 4, 8, 256), exact);
        let odd = sizes(23, 100, 5, 256);
        assert_eq!(odd.depth, 23, "as configured");
        assert_eq!(odd.ring, 32, "the ring rounded up");
        assert_eq!(odd.signal_interval, 11, "at most half the queue");
        assert_eq!(odd.slots, 32, "at least two intervals, rounded up");
        let spare = sizes(63, 16, 16, 256);
        assert_eq!((spare.depth, spare.ring), (63, 64));
        assert_eq!(
            sizes(256, 16, 64, 40).depth,
            40,
            "the QP's room bounds the depth"
        );
        assert_eq!(
            sizes(256, 16, 64, 1).depth,
            MIN_SQ_DEPTH,
            "never below the minimum"
        );
        assert_eq!(
            sizes(256, 0, 1, 256).signal_interval,
            1,
            "at least every request"
        );
    }
}
