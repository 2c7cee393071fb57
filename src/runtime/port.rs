//! What a runtime shares with one reactor thread: the queue new sessions and
//! submission rings arrive through, the stop and sleep flags, the published
//! statistics, and what other threads need to build QPs on its CQs.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering, fence};
use std::sync::mpsc::SyncSender;
use std::sync::{Arc, OnceLock};

use crossbeam_queue::ArrayQueue;
use crossbeam_utils::CachePadded;

use crate::error::{Error, Result};
use crate::reactor::{Counters, DatagramId, Waker};
use crate::session::{CqChoice, Endpoint, PeerHello, QpSpec};
use crate::verbs::{AccessFlags, QpConfig, SharedCq, SrqAttachment};

use super::submit::Consumer;
use super::{DatagramPlan, ReactorStats, SubmitLatency};

/// Something handed to a reactor thread.
pub(crate) enum Arrival {
    /// An established session to serve (its QPs are on this reactor's CQs).
    Session(Box<Incoming>),
    /// A submission ring from an application thread.
    Ring(Consumer),
    /// A datagram endpoint to open, and where to say how that went.
    Datagram(Box<DatagramArrival>),
}

impl Arrival {
    /// What it is, for errors.
    pub(crate) fn what(&self) -> &'static str {
        match self {
            Self::Session(_) => "session",
            Self::Ring(_) => "submission ring",
            Self::Datagram(_) => "datagram endpoint request",
        }
    }
}

/// A datagram endpoint asked for after the runtime started
/// ([`RuntimeHandle::add_datagram`](super::RuntimeHandle::add_datagram)).
pub(crate) struct DatagramArrival {
    pub(crate) plan: DatagramPlan,
    /// Takes the endpoint's id, or why it was not opened.
    pub(crate) reply: SyncSender<Result<DatagramId>>,
}

/// An established session on its way to its reactor.
pub(crate) struct Incoming {
    pub(crate) endpoint: Endpoint,
    pub(crate) seat: Seat,
    pub(crate) hello: Option<PeerHello>,
}

/// Counts a session placed on a reactor from the moment it is placed
/// (during its handshake already) until its handler is dropped, so the
/// fewest-sessions policy sees handshakes in flight too.
#[derive(Debug)]
pub(crate) struct Seat(Arc<AtomicUsize>);

impl Seat {
    pub(crate) fn new(count: &Arc<AtomicUsize>) -> Self {
        count.fetch_add(1, Ordering::AcqRel);
        Self(Arc::clone(count))
    }
}

impl Drop for Seat {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

/// What other threads need once the reactor is up.
pub(crate) struct Setup {
    pub(crate) waker: Waker,
    cqs: Vec<SharedCq>,
    srq: Option<SrqAttachment>,
    qp: QpConfig,
    next_cq: AtomicUsize,
}

impl Setup {
    pub(crate) fn new(waker: Waker, specs: Vec<QpSpec>) -> Self {
        let mut cqs = Vec::new();
        let (mut srq, mut qp) = (None, QpConfig::default());
        for spec in specs {
            match spec.cq {
                CqChoice::Shared(cq) => cqs.push(cq),
                CqChoice::Spread(spread) => cqs.extend(spread.cqs().iter().cloned()),
                CqChoice::Private { .. } => {}
            }
            srq = spec.srq;
            qp = spec.qp;
        }
        Self {
            waker,
            cqs,
            srq,
            qp,
            next_cq: AtomicUsize::new(0),
        }
    }

    /// The next of the reactor's CQs, round-robin.
    pub(crate) fn next_cq(&self) -> SharedCq {
        let i = self.next_cq.fetch_add(1, Ordering::Relaxed);
        self.cqs[i % self.cqs.len()].clone()
    }

    pub(crate) fn srq(&self) -> Option<SrqAttachment> {
        self.srq.clone()
    }

    /// A QP spec on this reactor's CQs and SRQ, with its queue depths.
    pub(crate) fn qp_spec(&self, name: String, remote_access: AccessFlags) -> QpSpec {
        let mut qp = self.qp.clone();
        qp.remote_access = remote_access;
        QpSpec {
            name,
            cq: CqChoice::Shared(self.next_cq()),
            qp,
            srq: self.srq(),
        }
    }

    /// The QP settings of the reactor (depths, inline size).
    pub(crate) fn qp_config(&self) -> &QpConfig {
        &self.qp
    }
}

/// Statistics a reactor publishes now and then (relaxed stores to a cache
/// line of its own).
#[derive(Default)]
pub(crate) struct StatCells {
    passes: AtomicU64,
    empty_passes: AtomicU64,
    completions: AtomicU64,
    messages: AtomicU64,
    requests: AtomicU64,
    doorbells: AtomicU64,
    sleeps: AtomicU64,
    flush_visits: AtomicU64,
    foreign_completions: AtomicU64,
    stale_completions: AtomicU64,
    reclaimed_receives: AtomicU64,
    datagrams: AtomicU64,
    sessions: AtomicU64,
    commands: AtomicU64,
    thread_id: AtomicU64,
    /// Submit-to-doorbell ages: samples (0: not traced), p50, p99, max.
    traced: [AtomicU64; 4],
}

impl StatCells {
    pub(crate) fn publish(&self, counters: &Counters, sessions: usize, commands: u64) {
        let store = |cell: &AtomicU64, value: u64| cell.store(value, Ordering::Relaxed);
        store(&self.passes, counters.passes);
        store(&self.empty_passes, counters.empty_passes);
        store(&self.completions, counters.completions);
        store(&self.messages, counters.messages);
        store(&self.requests, counters.requests);
        store(&self.doorbells, counters.doorbells);
        store(&self.sleeps, counters.sleeps);
        store(&self.flush_visits, counters.flush_visits);
        store(&self.foreign_completions, counters.foreign_completions);
        store(&self.stale_completions, counters.stale_completions);
        store(&self.reclaimed_receives, counters.reclaimed_receives);
        store(&self.datagrams, counters.datagrams);
        store(&self.sessions, sessions as u64);
        store(&self.commands, commands);
    }

    pub(crate) fn publish_trace(&self, latency: &SubmitLatency) {
        let values = [
            latency.samples,
            latency.p50_ns,
            latency.p99_ns,
            latency.max_ns,
        ];
        for (cell, value) in self.traced.iter().zip(values) {
            cell.store(value, Ordering::Relaxed);
        }
    }

    pub(crate) fn set_thread_id(&self, tid: u64) {
        self.thread_id.store(tid, Ordering::Relaxed);
    }
}

/// One reactor as the other threads see it.
pub(crate) struct Port {
    pub(crate) index: usize,
    pub(crate) core: Option<usize>,
    pub(crate) arrivals: ArrayQueue<Arrival>,
    /// Asked to stop.
    pub(crate) stop: AtomicBool,
    /// The thread is in its loop (false before it starts and once it ends).
    pub(crate) running: AtomicBool,
    /// The reactor is about to sleep or sleeping: a producer must wake it.
    sleeping: CachePadded<AtomicBool>,
    /// The reactor may sleep (Blocking and Epoll modes).
    pub(crate) may_sleep: bool,
    /// Sessions placed on the reactor and not yet gone.
    pub(crate) seats: Arc<AtomicUsize>,
    pub(crate) stats: CachePadded<StatCells>,
    pub(crate) setup: OnceLock<Setup>,
}

impl Port {
    pub(crate) fn new(index: usize, core: Option<usize>, queue: usize, may_sleep: bool) -> Self {
        Self {
            index,
            core,
            arrivals: ArrayQueue::new(queue.max(1)),
            stop: AtomicBool::new(false),
            running: AtomicBool::new(false),
            sleeping: CachePadded::new(AtomicBool::new(false)),
            may_sleep,
            seats: Arc::new(AtomicUsize::new(0)),
            stats: CachePadded::default(),
            setup: OnceLock::new(),
        }
    }

    /// Takes new work: running and not asked to stop.
    pub(crate) fn is_open(&self) -> bool {
        self.running.load(Ordering::Acquire) && !self.stop.load(Ordering::Acquire)
    }

    /// Wakes the reactor if it sleeps, after something was queued for it.
    /// Pairs with [`going_to_sleep`](Self::going_to_sleep): either the
    /// reactor sees what was queued before it sleeps, or this sees it
    /// sleeping and wakes it. Costs nothing but a fence while it runs.
    #[inline]
    pub(crate) fn nudge(&self) {
        if !self.may_sleep {
            return;
        }
        fence(Ordering::SeqCst);
        if self.sleeping.load(Ordering::Relaxed)
            && self.sleeping.swap(false, Ordering::AcqRel)
            && let Some(setup) = self.setup.get()
        {
            setup.waker.wake();
        }
    }

    /// Announces that the reactor will sleep unless it then finds work.
    pub(crate) fn going_to_sleep(&self) {
        self.sleeping.store(true, Ordering::Relaxed);
        fence(Ordering::SeqCst);
    }

    pub(crate) fn awake(&self) {
        self.sleeping.store(false, Ordering::Relaxed);
    }

    /// Empties the queue of a reactor that stopped: each session goes to
    /// `refused` after its endpoint is dropped (telling the peer goodbye);
    /// rings are dropped, and their submitters see the stop; each datagram
    /// endpoint asked for is refused to the caller waiting for it.
    pub(crate) fn refuse_queued(&self, refused: impl Fn(usize, SocketAddr, &Error)) {
        // Everything is taken off the queue before `refused` runs: a
        // caller of `add_datagram` waiting here is answered (its reply
        // dropped) even if `refused` panics.
        let mut sessions = Vec::new();
        while let Some(arrival) = self.arrivals.pop() {
            if let Arrival::Session(incoming) = arrival {
                sessions.push(incoming);
            }
        }
        for incoming in sessions {
            let peer = incoming.endpoint.peer();
            drop(incoming);
            let err = Error::Runtime(format!(
                "reactor {} stopped before it took the session",
                self.index
            ));
            refused(self.index, peer, &err);
        }
    }

    /// Asks the reactor to stop and wakes it.
    pub(crate) fn ask_to_stop(&self) {
        self.stop.store(true, Ordering::Release);
        if let Some(setup) = self.setup.get() {
            setup.waker.wake();
        }
    }

    pub(crate) fn snapshot(&self) -> ReactorStats {
        let load = |cell: &AtomicU64| cell.load(Ordering::Relaxed);
        let cells = &self.stats;
        ReactorStats {
            reactor: self.index,
            core: self.core,
            thread_id: load(&cells.thread_id),
            running: self.running.load(Ordering::Acquire),
            sessions: load(&cells.sessions) as usize,
            commands: load(&cells.commands),
            counters: Counters {
                passes: load(&cells.passes),
                empty_passes: load(&cells.empty_passes),
                completions: load(&cells.completions),
                messages: load(&cells.messages),
                requests: load(&cells.requests),
                doorbells: load(&cells.doorbells),
                sleeps: load(&cells.sleeps),
                flush_visits: load(&cells.flush_visits),
                foreign_completions: load(&cells.foreign_completions),
                stale_completions: load(&cells.stale_completions),
                reclaimed_receives: load(&cells.reclaimed_receives),
                datagrams: load(&cells.datagrams),
            },
            submit_latency: (load(&cells.traced[0]) > 0).then(|| SubmitLatency {
                samples: load(&cells.traced[0]),
                p50_ns: load(&cells.traced[1]),
                p99_ns: load(&cells.traced[2]),
                max_ns: load(&cells.traced[3]),
            }),
        }
    }
}
