//! One reactor thread: pins itself, builds its reactor (its CQs, its SRQ),
//! then runs passes: new sessions and rings from its queue when idle (and
//! every so many busy passes), commands from the rings staged before each
//! pass so they share its doorbells, and in the event modes a sleep that
//! only a completion, a peer, a new arrival or a stop ends.

use std::sync::Arc;
use std::sync::mpsc::SyncSender;

use crate::error::{Error, Result};
use crate::reactor::{DatagramId, EventMode, Reactor, ReactorConfig, SendError};
use crate::verbs::{AccessFlags, ProtectionDomain};

use super::DatagramPlan;
use super::factory::{HandlerFactory, NewDatagram, NewSession, Seated};
use super::port::{Arrival, DatagramArrival, Incoming, Port, Setup};
use super::submit::Consumer;
use super::trace::Tracer;
use crate::clock::Clock;

/// Busy passes between two looks at the arrival queue (idle passes always
/// look): a saturated reactor still takes newcomers.
const ARRIVAL_CHECK_PASSES: u32 = 256;
/// Passes between two publications of the statistics (and always before
/// sleeping, and at the end).
const PUBLISH_PASSES: u32 = 1024;

thread_local! {
    /// Set on the thread of a runtime's reactor (of any runtime), for its
    /// life.
    static REACTOR_THREAD: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Whether the calling thread is a runtime reactor's: one that must never
/// wait for a reactor.
pub(crate) fn on_reactor_thread() -> bool {
    REACTOR_THREAD.with(std::cell::Cell::get)
}

/// Everything a reactor thread starts from.
pub(crate) struct Start<F> {
    pub(crate) port: Arc<Port>,
    pub(crate) pd: ProtectionDomain,
    pub(crate) config: ReactorConfig,
    pub(crate) factory: Arc<F>,
    /// The datagram endpoints this reactor opens as it starts.
    pub(crate) datagrams: Vec<DatagramPlan>,
    /// The clock of traced submissions.
    pub(crate) trace: Option<Clock>,
    pub(crate) ready: SyncSender<Result<()>>,
}

/// The thread's body: set-up, then the loop until stopped. The reactor (and
/// with it every session it serves) is dropped on the way out, telling the
/// peers goodbye.
pub(crate) fn run<F: HandlerFactory>(start: Start<F>) -> Result<()> {
    REACTOR_THREAD.with(|flag| flag.set(true));
    let Start {
        port,
        pd,
        config,
        factory,
        datagrams,
        trace,
        ready,
    } = start;
    let set_up = set_up::<F>(&port, &pd, config).and_then(|mut reactor| {
        match open_datagrams(&mut reactor, &datagrams, &*factory, port.index) {
            Ok(()) => Ok(reactor),
            Err(err) => {
                // The handlers built before the failure come back as a
                // stopping reactor's do.
                for (id, seated) in reactor.into_datagram_handlers() {
                    factory.datagram_stopped(port.index, id, seated.handler);
                }
                Err(err)
            }
        }
    });
    let mut reactor = match set_up {
        Ok(reactor) => {
            port.running
                .store(true, std::sync::atomic::Ordering::Release);
            let _ = ready.send(Ok(()));
            reactor
        }
        Err(err) => {
            let message = err.to_string();
            let _ = ready.send(Err(err));
            return Err(Error::Runtime(format!(
                "reactor {} did not start: {message}",
                port.index
            )));
        }
    };
    let mut worker = Worker {
        port: &port,
        factory: &*factory,
        rings: Vec::new(),
        commands: 0,
        tracer: trace.map(Tracer::new),
    };
    // A panic in a handler or the factory ends this reactor like an error:
    // it is marked closed and its queue drained, so placement stops sending
    // peers to a thread that no longer serves them.
    let result =
        std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| worker.serve(&mut reactor)))
            .unwrap_or_else(|_| {
                Err(Error::Runtime(
                    "a handler or the handler factory panicked".into(),
                ))
            });
    port.running
        .store(false, std::sync::atomic::Ordering::Release);
    // Pairs with the fence in `Shared::deliver`: a producer that pushes
    // after this drain sees `running` false and drains its arrival itself.
    std::sync::atomic::fence(std::sync::atomic::Ordering::SeqCst);
    worker.publish(&reactor);
    port.refuse_queued(|reactor, peer, err| factory.refused(reactor, peer, err));
    // The sessions still served go one by one (QPs destroyed, the peer told
    // goodbye as the link drops), and their handlers back to the factory.
    let served: Vec<_> = reactor.sessions().collect();
    for session in served {
        if let Some((link, seated)) = reactor.remove(session) {
            drop(link);
            let Seated { handler, _seat } = seated;
            drop(_seat);
            factory.stopped(port.index, handler);
        }
    }
    // The datagram endpoints' handlers too, once their QPs are destroyed
    // with the reactor.
    for (id, seated) in reactor.into_datagram_handlers() {
        factory.datagram_stopped(port.index, id, seated.handler);
    }
    result.map_err(|err| Error::Runtime(format!("reactor {} failed: {err}", port.index)))
}

/// Opens the datagram endpoints `datagrams` on reactor `index`, each with
/// a handler from `factory`, and joins their groups.
fn open_datagrams<F: HandlerFactory>(
    reactor: &mut Reactor<Seated<F::Handler>>,
    datagrams: &[DatagramPlan],
    factory: &F,
    index: usize,
) -> Result<()> {
    for plan in datagrams {
        open_datagram(reactor, plan, factory, index)?;
    }
    Ok(())
}

/// Opens the datagram endpoint `plan` asks for on reactor `index`, with a
/// handler from `factory`, and joins its groups. An endpoint that cannot
/// join one is removed, and its handler goes to the factory's
/// `datagram_stopped`.
fn open_datagram<F: HandlerFactory>(
    reactor: &mut Reactor<Seated<F::Handler>>,
    plan: &DatagramPlan,
    factory: &F,
    index: usize,
) -> Result<DatagramId> {
    let id = reactor.add_datagram(&plan.config, |id, qp| {
        let datagram = NewDatagram {
            reactor: index,
            id,
            qp,
        };
        let handler = factory.build_datagram(&datagram)?;
        Ok(Seated {
            handler,
            _seat: None,
        })
    })?;
    for &group in &plan.groups {
        if let Err(err) = reactor.join(id, group) {
            if let Some(seated) = reactor.remove_datagram(id) {
                factory.datagram_stopped(index, id, seated.handler);
            }
            return Err(err);
        }
    }
    Ok(id)
}

fn set_up<F: HandlerFactory>(
    port: &Port,
    pd: &ProtectionDomain,
    config: ReactorConfig,
) -> Result<Reactor<Seated<F::Handler>>> {
    if let Some(core) = port.core
        && !core_affinity::set_for_current(core_affinity::CoreId { id: core })
    {
        return Err(Error::Runtime(format!(
            "reactor {} could not be pinned to core {core}",
            port.index
        )));
    }
    // SAFETY: gettid has no preconditions.
    let tid = unsafe { libc::gettid() };
    port.stats.set_thread_id(tid as u64);
    let mut reactor = Reactor::new(pd, config)?;
    let specs = (0..reactor.config().cq_count.max(1))
        .map(|_| reactor.qp_spec_with_access("", AccessFlags::empty()))
        .collect();
    let _ = port.setup.set(Setup::new(reactor.waker(), specs));
    Ok(reactor)
}

struct Worker<'a, F> {
    port: &'a Port,
    factory: &'a F,
    rings: Vec<Consumer>,
    /// Commands staged from the rings.
    commands: u64,
    /// Submit-to-doorbell ages, when traced.
    tracer: Option<Tracer>,
}

impl<F: HandlerFactory> Worker<'_, F> {
    fn serve(&mut self, reactor: &mut Reactor<Seated<F::Handler>>) -> Result<()> {
        let may_sleep = reactor.config().event_mode != EventMode::BusyPoll;
        let port = self.port;
        let (mut busy_passes, mut since_publish) = (0u32, 0u32);
        let mut look = true;
        // A handler's Ctx::stop stops this reactor.
        while !port.stop.load(std::sync::atomic::Ordering::Acquire) && !reactor.stop_requested() {
            if look || busy_passes >= ARRIVAL_CHECK_PASSES {
                self.take_arrivals(reactor);
                busy_passes = 0;
            }
            if !self.rings.is_empty() {
                self.stage_commands(reactor);
            }
            let done = reactor.poll_once()?;
            // The pass has rung its doorbells, staged commands included.
            if let Some(tracer) = &mut self.tracer {
                tracer.doorbells_rung();
            }
            look = done == 0;
            busy_passes += 1;
            since_publish += 1;
            if since_publish >= PUBLISH_PASSES {
                self.publish(reactor);
                since_publish = 0;
            }
            if done == 0 && may_sleep && reactor.prepare_wait()?.is_some() {
                self.publish(reactor);
                since_publish = 0;
                port.going_to_sleep();
                if !self.has_news() && !reactor.stop_requested() {
                    reactor.wait()?;
                }
                port.awake();
            }
        }
        Ok(())
    }

    /// Something arrived or was asked since the reactor last looked.
    fn has_news(&self) -> bool {
        self.port.stop.load(std::sync::atomic::Ordering::Acquire)
            || !self.port.arrivals.is_empty()
            || self.rings.iter().any(Consumer::has_news)
    }

    /// Serves the sessions and takes the rings that arrived.
    #[cold]
    fn take_arrivals(&mut self, reactor: &mut Reactor<Seated<F::Handler>>) {
        while let Some(arrival) = self.port.arrivals.pop() {
            match arrival {
                Arrival::Ring(ring) => self.rings.push(ring),
                Arrival::Datagram(asked) => {
                    let DatagramArrival { plan, reply } = *asked;
                    let opened = open_datagram(reactor, &plan, self.factory, self.port.index);
                    let _ = reply.send(opened);
                }
                Arrival::Session(incoming) => {
                    let Incoming {
                        endpoint,
                        seat,
                        hello,
                    } = *incoming;
                    let peer = endpoint.peer();
                    let session = NewSession {
                        reactor: self.port.index,
                        endpoint: &endpoint,
                        hello: hello.as_ref(),
                    };
                    let added = self.factory.build(&session).and_then(|handler| {
                        reactor.add(
                            endpoint,
                            Seated {
                                handler,
                                _seat: Some(seat),
                            },
                        )
                    });
                    if let Err(err) = added {
                        self.factory.refused(self.port.index, peer, &err);
                    }
                }
            }
        }
    }

    /// Stages the rings' commands in order until a connection cannot take
    /// one (it waits there for a completion to make room).
    #[inline]
    fn stage_commands(&mut self, reactor: &mut Reactor<Seated<F::Handler>>) {
        let (rings, tracer) = (&mut self.rings, &mut self.tracer);
        let staged = reactor.with_ctx(|ctx| {
            let mut staged = 0;
            for ring in rings.iter_mut() {
                while let Some((command, payload)) = ring.peek() {
                    match ctx.send(command.conn, payload, command.imm()) {
                        Ok(_) => {
                            if let Some(tracer) = tracer.as_mut()
                                && let Some(stamp) = ring.stamp()
                            {
                                let _ = tracer.staged.try_push(stamp);
                            }
                            ring.pop(true);
                            staged += 1;
                        }
                        Err(SendError::WouldBlock) => {
                            ring.noted();
                            break;
                        }
                        Err(_) => ring.pop(false),
                    }
                }
            }
            staged
        });
        self.commands += staged;
        if self.rings.iter().any(Consumer::is_finished) {
            self.rings.retain(|ring| !ring.is_finished());
        }
    }

    fn publish(&mut self, reactor: &Reactor<Seated<F::Handler>>) {
        let sessions = reactor.sessions().count();
        self.port
            .stats
            .publish(&reactor.counters(), sessions, self.commands);
        if let Some(tracer) = &mut self.tracer
            && let Some(latency) = tracer.new_summary()
        {
            self.port.stats.publish_trace(&latency);
        }
    }
}
