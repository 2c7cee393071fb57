//! # rdma-comm-core
//!
//! An RDMA runtime for latency-critical services: RC queue pairs over
//! InfiniBand and RoCE with SEND, RECV, WRITE, WRITE_WITH_IMM and READ, a
//! data path that allocates nothing, typed errors and RAII ownership of
//! every verbs object. The guides are in the repository's `docs/`
//! directory; this page introduces the layers, each of which imports only
//! the ones above it in this list.
//!
//! - **`sys`** (private): bindgen's bindings to libibverbs and librdmacm.
//!   Only [`verbs`] uses them.
//! - **[`verbs`]**: the safe layer over libibverbs. Contexts, protection
//!   domains, memory regions and windows, CQs, QPs and SRQs are handles that
//!   own their parents, so any drop order is safe; posting is bounds-checked
//!   against registered regions and takes `&mut QueuePair`.
//!   [`verbs::cm`] connects QPs through the RDMA connection manager, and
//!   [`verbs::Context::loopback`] is an in-process device for tests.
//! - **[`session`]**: the control plane. A [`session::ClientSession`]
//!   connects to a [`session::ServerSession`] over TCP or rdma_cm, proves a
//!   shared [`session::AuthKey`] with HMAC-SHA256, and gets an
//!   [`session::Endpoint`] of connected QPs and the peer's exported regions,
//!   reachable only through memory windows bound for that peer. Servers
//!   require a key unless configured with
//!   [`session::ServerConfig::insecure_open`].
//! - **[`pool`]**: registered buffer pools whose move-only slots cannot be
//!   reused while a request on them is in flight.
//! - **[`reactor`]**: a run-to-completion loop on one thread that owns
//!   shared CQs, keeps receive rings posted, runs credit-based flow control
//!   and calls a [`reactor::Handler`] per session; handlers stage work
//!   through a [`reactor::Ctx`].
//! - **[`runtime`]**: one reactor per pinned core, placement of new
//!   sessions at admission, and lock-free submission rings for other
//!   threads.
//!
//! [`clock`] reads the TSC; [`Error`] is every layer's error type.
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
//! qp.post_recv(&mut RecvRequest::new(1, mr.slice(0, 2048)?)?)?;
//! mr.write(2048, b"hello")?;
//! qp.post_send(&mut WorkRequest::send(2, mr.slice(2048, 5)?).signaled())?;
//! let mut wcs = [WorkCompletion::default(); 16];
//! for wc in cq.poll(&mut wcs)? {
//!     wc.ok()?;
//! }
//! # Ok::<(), rdma_comm_core::Error>(())
//! ```
//!
//! The README's echo server and client show the session, reactor and
//! runtime layers together.
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

/// What a service that embeds a handler uses, in one import:
/// `use rdma_comm_core::prelude::*;`.
pub mod prelude {
    pub use crate::error::{Error, Result};
    pub use crate::reactor::{
        ConnId, Ctx, DatagramId, DatagramSource, Ended, EventMode, Handler, HeldRecv, Idle, NoLink,
        Reactor, ReactorConfig, SendError, SessionId, Stopper,
    };
    pub use crate::runtime::{NewSession, Runtime, RuntimeConfig};
    pub use crate::session::{
        AuthKey, ClientConfig, ClientSession, Endpoint, Export, PeerStatus, ServerConfig,
        ServerSession, Transport,
    };
    pub use crate::verbs::{
        AccessFlags, Context, Gid, ProtectionDomain, UdConfig, UdDestination, UdQueuePair,
    };
}

/// Compiles the code examples of the README and of every page in `docs/`
/// as doc tests.
#[cfg(doctest)]
mod doc_pages {
    #[doc = include_str!("../README.md")]
    pub struct Readme;
    #[doc = include_str!("../docs/architecture.md")]
    pub struct Architecture;
    #[doc = include_str!("../docs/verbs.md")]
    pub struct Verbs;
    #[doc = include_str!("../docs/sessions.md")]
    pub struct Sessions;
    #[doc = include_str!("../docs/rdma-cm.md")]
    pub struct RdmaCm;
    #[doc = include_str!("../docs/security.md")]
    pub struct Security;
    #[doc = include_str!("../docs/safety.md")]
    pub struct Safety;
    #[doc = include_str!("../docs/reactor.md")]
    pub struct Reactor;
    #[doc = include_str!("../docs/datagrams.md")]
    pub struct Datagrams;
    #[doc = include_str!("../docs/runtime.md")]
    pub struct Runtime;
    #[doc = include_str!("../docs/testing.md")]
    pub struct Testing;
    #[doc = include_str!("../docs/faults.md")]
    pub struct Faults;
    #[doc = include_str!("../docs/performance.md")]
    pub struct Performance;
    #[doc = include_str!("../docs/tools.md")]
    pub struct Tools;
}
