//! How a runtime is laid out ([`RuntimeConfig`]): its reactors and cores,
//! each reactor's configuration, placement, the queues sessions and
//! commands arrive through, and the datagram endpoints each reactor opens
//! ([`DatagramPlan`]).

use crate::reactor::ReactorConfig;
use crate::verbs::{Gid, UdConfig};

use super::{CoreChoice, PlacementPolicy};
#[cfg(doc)]
use super::{HandlerFactory, INLINE_PAYLOAD, ReactorStats};

/// Largest payload slot of a submission ring entry.
pub const MAX_SUBMIT_SLOT: usize = 1 << 20;
/// Most commands in one submission ring.
pub const MAX_SUBMIT_RING: usize = 1 << 16;

/// How many reactors, where, and how sessions and commands reach them.
#[derive(Debug, Clone)]
pub struct RuntimeConfig {
    /// Reactor threads, one per core.
    pub reactors: usize,
    /// Which cores they are pinned to.
    pub cores: CoreChoice,
    /// Every reactor's configuration (event mode, queue depths, CQs sized
    /// for the sessions one reactor serves: see [`ReactorConfig::absorbing`]).
    /// In the Blocking and Epoll modes the runtime sleeps until woken
    /// ([`ReactorConfig::sleeping_until_woken`]) unless `idle_timeout` is
    /// set shorter than the default's.
    pub reactor: ReactorConfig,
    /// How sessions are spread over the reactors.
    pub policy: PlacementPolicy,
    /// Sessions and rings waiting in each reactor's arrival queue at most.
    pub arrival_queue: usize,
    /// Commands in each submission ring (rounded up to a power of two).
    pub submit_ring: usize,
    /// Payload bytes each submission ring entry can carry beyond the
    /// [`INLINE_PAYLOAD`] that fit in the command (0: inline only; at most
    /// [`MAX_SUBMIT_SLOT`]).
    pub submit_slot_size: usize,
    /// Name prefix of the reactor threads (`NAME-0`, `NAME-1`, ...).
    pub thread_name: String,
    /// Measure how long submitted commands wait until the pass that posts
    /// them has returned from its doorbells (the end of that pass:
    /// [`ReactorStats::submit_latency`]): one TSC read per command on the
    /// submitting thread, one per pass that staged commands on the reactor,
    /// and a walk over the histogram when the statistics are published
    /// after new samples. At most 64 commands a pass are sampled. Off by
    /// default.
    pub trace_submissions: bool,
    /// Datagram endpoints (UD QPs on a reactor's CQs, see
    /// [`Reactor::add_datagram`](crate::reactor::Reactor::add_datagram))
    /// each reactor opens as it starts, before it serves anything; their
    /// handlers come from [`HandlerFactory::build_datagram`]. Each is open
    /// to anyone on the fabric (it logs so). None by default.
    pub datagrams: Vec<DatagramPlan>,
}

/// A datagram endpoint a runtime reactor opens as it starts
/// ([`RuntimeConfig::datagrams`]).
#[derive(Debug, Clone, Default)]
pub struct DatagramPlan {
    /// The reactor that serves it: below [`RuntimeConfig::reactors`].
    pub reactor: usize,
    /// Its UD QP's depths, inline room, Q_Key, port and GID.
    pub config: UdConfig,
    /// Multicast groups (IPv4-mapped GIDs of multicast addresses) it joins
    /// before the reactor serves anything.
    pub groups: Vec<Gid>,
}

impl Default for RuntimeConfig {
    fn default() -> Self {
        Self {
            reactors: 1,
            cores: CoreChoice::NearDevice,
            reactor: ReactorConfig::default(),
            policy: PlacementPolicy::RoundRobin,
            arrival_queue: 256,
            submit_ring: 1024,
            submit_slot_size: 1024,
            thread_name: "rdma-reactor".into(),
            trace_submissions: false,
            datagrams: Vec::new(),
        }
    }
}
