//! What a run measures: the operation, sizes and counts, the buffers, and the
//! marker that ends it.

use std::fmt;

use rdma_comm_core::verbs::{MemoryRegion, RemoteRegion};

/// Immediate value of the message that ends a run.
pub const DONE_MARKER: u32 = u32::MAX;

/// The operation measured.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PerfOp {
    /// SEND/RECV.
    Send,
    /// RDMA WRITE (latency: answered by a WRITE the peer detects by polling).
    Write,
    /// RDMA WRITE_WITH_IMM (answered the same way).
    WriteImm,
    /// RDMA READ.
    Read,
}

impl fmt::Display for PerfOp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            PerfOp::Send => "send",
            PerfOp::Write => "write",
            PerfOp::WriteImm => "write_imm",
            PerfOp::Read => "read",
        })
    }
}

/// What to measure.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PerfSpec {
    /// The operation.
    pub op: PerfOp,
    /// Message size in bytes.
    pub size: usize,
    /// Measured iterations (a client runs at least one: see
    /// [`PerfSpec::runnable`]).
    pub iters: u64,
    /// Unmeasured iterations first.
    pub warmup: u64,
    /// Bandwidth: most requests per doorbell.
    pub batch: usize,
    /// Bandwidth: most requests outstanding (posted and not yet known
    /// complete), perftest's `-t`; 0 leaves it to the send queue and the
    /// credits. Without a bound, a fast sender keeps hundreds of large
    /// WRITEs queued at once, which no NIC needs to stay busy.
    pub tx_depth: u64,
}

impl PerfSpec {
    /// The spec as every client runs it: at least one measured iteration,
    /// and a warmup short enough that `warmup + iters` fits in a `u64`, so
    /// the clients' plain sums cannot wrap. A latency client ends when its
    /// count of iterations reaches `warmup + iters`, which with no warmup
    /// and 0 iterations it passed at the first answer and never met; a
    /// sender of 0 messages would wait for a completion that never comes.
    /// With a warmup and 0 iterations, one is measured after the warmup.
    #[must_use]
    pub fn runnable(mut self) -> Self {
        self.iters = self.iters.max(1);
        self.warmup = self.warmup.min(u64::MAX - self.iters);
        self
    }
}

/// Buffers one side needs. `buffer` holds `2 × size` bytes and is exported:
/// the first half is where the peer's WRITEs land (and what READs fetch), the
/// second half is the source of our own WRITEs, so polling the landing half
/// never sees our own marker.
#[derive(Debug)]
pub struct PerfBuffers {
    /// This side's buffer.
    pub buffer: MemoryRegion,
    /// The peer's exported buffer.
    pub peer: RemoteRegion,
}

#[cfg(test)]
mod tests {
    use super::{PerfOp, PerfSpec};

    fn spec(iters: u64, warmup: u64) -> PerfSpec {
        PerfSpec {
            op: PerfOp::Send,
            size: 8,
            iters,
            warmup,
            batch: 1,
            tx_depth: 0,
        }
    }

    /// A runnable spec measures at least one iteration and its total
    /// count fits in a `u64`; one that already did is left as it was.
    #[test]
    fn a_runnable_spec_measures_one_and_its_total_fits() {
        let zero = spec(0, 0).runnable();
        assert_eq!((zero.iters, zero.warmup), (1, 0));
        let huge = spec(u64::MAX - 3, u64::MAX).runnable();
        assert_eq!(huge.warmup, 3, "warmup + iters must not wrap");
        assert_eq!(huge.warmup.checked_add(huge.iters), Some(u64::MAX));
        assert_eq!(spec(20_000, 2_000).runnable(), spec(20_000, 2_000));
    }
}
