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
    /// [`PerfSpec::at_least_one_iteration`]).
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
    /// The same spec with at least one measured iteration, as every
    /// client runs it: a latency client ends when its count of iterations
    /// reaches `warmup + iters`, which with no warmup and 0 iterations it
    /// passed at the first answer and never met; a sender of 0 messages
    /// would wait for a completion that never comes. With a warmup and
    /// 0 iterations, one is measured after the warmup.
    #[must_use]
    pub fn at_least_one_iteration(mut self) -> Self {
        self.iters = self.iters.max(1);
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
