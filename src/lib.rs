//! # rdma-comm-core
//!
//! A Rust RDMA runtime for latency-critical services: RC queue pairs over
//! InfiniBand and RoCE with SEND, RECV, WRITE, WRITE_WITH_IMM and READ, a
//! zero-allocation data path, typed errors and RAII ownership of every verbs
//! object.
//!
//! The [`verbs`] module is the safe layer over libibverbs. Its objects own their
//! parents, so teardown order is always right, and its posting calls are
//! bounds-checked against registered regions.
//!
//! ## Quick start
//!
//! ```no_run
//! use rdma_comm_core::verbs::*;
//!
//! let ctx = Context::open_default(None)?;          // first device with an active port
//! let pd = ctx.alloc_pd()?;
//! let mut cq = ctx.create_cq(256, None)?;
//! let mut mr = pd.alloc_mr(4096, AccessFlags::LOCAL_WRITE)?;
//! let mut qp = pd.create_qp(&cq, &cq, &QpConfig::default())?;
//! // exchange qp.endpoint() with the peer out of band, then:
//! # let peer = qp.endpoint();
//! qp.connect(&peer)?;
//! qp.post_recv(RecvRequest::new(1, mr.slice(0, 2048)?)?)?;
//! mr.write(2048, b"hello")?;
//! qp.post_send(WorkRequest::send(2, mr.slice(2048, 5)?).signaled())?;
//! let mut wcs = [WorkCompletion::default(); 16];
//! for wc in cq.poll(&mut wcs)? {
//!     wc.ok()?;
//! }
//! # Ok::<(), rdma_comm_core::Error>(())
//! ```
//!
//! ## Thread safety
//!
//! Contexts, PDs, MRs and QPs are `Send + Sync` (libibverbs synchronises them).
//! A [`verbs::CompletionQueue`] is polled through `&mut self`: one thread owns it.
//!
//! ## Resource cleanup
//!
//! Every handle destroys its verbs object on drop. Children hold their parents:
//! a QP keeps its CQs and PD alive, an MR its PD, everything the device context.
//! Errors during teardown are logged, never panicked on.
#![deny(missing_docs, missing_debug_implementations)]
#![deny(unsafe_op_in_unsafe_fn)]

pub mod clock;
pub mod error;
pub mod pool;
pub mod reactor;
pub mod runtime;
pub mod session;
mod sys;
pub mod verbs;

pub use error::{Error, Result};

/// Compiles the README's code examples as doc tests.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
pub struct ReadmeDoctests;
