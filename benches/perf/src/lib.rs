//! # rdma-perf
//!
//! Latency and bandwidth measurement through the reactor, with perftest's
//! method and output format. Used by `examples/lat_bw` (and through it
//! `tools/compare-perftest`) and the criterion benchmarks; `examples/ping_pong`
//! and `tools/mesh` take its [`Clock`]. It is a crate of its own so that a
//! service embedding `rdma-comm-core` compiles none of it.
//!
//! Latency is a ping-pong: SEND and WRITE_WITH_IMM are answered the same way,
//! and WRITE is answered by a WRITE that the peer notices by polling the last
//! byte of its buffer, as `ib_write_lat` does. SEND and WRITE report half the
//! round trip; READ reports the full time of one READ. Times come from the TSC
//! (quanta). Bandwidth streams `iters` messages with at most `batch` requests
//! per doorbell. Both sides end when the client sends a final marker message.
//! The UD roles run the same tests on the reactor's datagram endpoints.
#![deny(missing_docs, missing_debug_implementations)]
#![deny(unsafe_op_in_unsafe_fn)]

mod datagram;
mod direct;
mod handler;
mod latency;
pub mod loopback;
mod rate;
mod run_end;
mod spec;
mod spread;
mod stats;

pub use datagram::{RESEND_AFTER, UdClient, UdExchange, UdServer};
pub use direct::{DirectClient, DirectServer, MAX_BATCH, SIGNAL_EVERY};
pub use handler::PerfHandler;
pub use latency::{LatencyClient, Reflector};
pub use rate::{RateSender, RateSink};
pub use rdma_comm_core::clock::Clock;
pub use spec::{DONE_MARKER, PerfBuffers, PerfOp, PerfSpec};
pub use spread::{BATCH, IN_FLIGHT, SPREAD_SIZE, Spread, SpreadRun, SpreadSender};
pub use stats::{BandwidthStats, LATENCY_HEADER, LatencyStats, bandwidth_header};
