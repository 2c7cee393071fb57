//! Controlling a running runtime from any thread ([`RuntimeHandle`]).

use std::fmt;
use std::sync::Arc;

use crate::error::{Error, Result};
use crate::session::{Endpoint, QpSpec, ServerConfig, ServerShutdown};
use crate::verbs::{AccessFlags, ProtectionDomain};

use super::port::{Arrival, DatagramArrival, Incoming, Seat};
use super::{DatagramPlan, ReactorLoad, ReactorStats, Shared, Submitter, submit, worker};
#[cfg(doc)]
use super::{HandlerFactory, Runtime};
use crate::reactor::DatagramId;

/// Controls a runtime from any thread: stop it or one reactor, read the
/// statistics, hand sessions to reactors, open submission rings. Cheap to
/// clone.
#[derive(Clone)]
pub struct RuntimeHandle {
    pub(super) shared: Arc<Shared>,
}

impl fmt::Debug for RuntimeHandle {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RuntimeHandle")
            .field("reactors", &self.shared.ports.len())
            .finish()
    }
}

impl RuntimeHandle {
    /// Number of reactors.
    pub fn reactors(&self) -> usize {
        self.shared.ports.len()
    }

    /// The protection domain every reactor's QPs and regions belong to.
    pub fn pd(&self) -> &ProtectionDomain {
        &self.shared.pd
    }

    /// A server configuration with the reactors' QP settings and
    /// `remote_access` granted to peers; pass it to [`Runtime::serve`]
    /// after setting exports, limits and the key (it has none: a server
    /// without one refuses to start unless `insecure_open` says so).
    pub fn server_config(&self, remote_access: AccessFlags) -> ServerConfig {
        let mut qp = self.shared.ports[0]
            .setup
            .get()
            .map(|setup| setup.qp_config().clone())
            .unwrap_or_default();
        qp.remote_access = remote_access;
        ServerConfig {
            qp,
            ..ServerConfig::default()
        }
    }

    /// A QP spec on reactor `reactor`'s CQs (round-robin over them) and
    /// SRQ, with its queue depths, for a client the application connects
    /// and then hands over with [`adopt`](Self::adopt).
    ///
    /// # Errors
    /// [`Error::Runtime`] for an index out of range or a reactor not running.
    pub fn qp_spec(
        &self,
        reactor: usize,
        name: impl Into<String>,
        remote_access: AccessFlags,
    ) -> Result<QpSpec> {
        let port = self.shared.port(reactor)?;
        let setup = port
            .setup
            .get()
            .filter(|_| port.is_open())
            .ok_or_else(|| Error::Runtime(format!("reactor {reactor} is not running")))?;
        Ok(setup.qp_spec(name.into(), remote_access))
    }

    /// The reactor the policy picks for a session without a hello (round
    /// robin, or the fewest sessions).
    ///
    /// # Errors
    /// [`Error::Runtime`] when no reactor runs.
    pub fn choose_reactor(&self) -> Result<usize> {
        self.shared.choose(None).map_err(Error::Runtime)
    }

    /// Hands a connected endpoint, whose QPs were built from
    /// [`qp_spec`](Self::qp_spec)`(reactor, ..)`, to that reactor: its
    /// factory builds the handler there and the reactor serves it.
    ///
    /// # Errors
    /// [`Error::Runtime`] when the reactor has stopped or its arrival queue
    /// is full (the endpoint is dropped, telling the peer goodbye). A
    /// reactor that stops while the endpoint is on its way hands it to the
    /// factory's [`refused`](HandlerFactory::refused) instead.
    pub fn adopt(&self, reactor: usize, endpoint: Endpoint) -> Result<()> {
        let port = self.shared.port(reactor)?;
        let arrival = Arrival::Session(Box::new(Incoming {
            endpoint,
            seat: Seat::new(&port.seats),
            hello: None,
        }));
        self.shared.deliver(reactor, arrival)
    }

    /// Opens a datagram endpoint on reactor `plan.reactor` of the running
    /// runtime, as [`RuntimeConfig::datagrams`](super::RuntimeConfig::datagrams)
    /// does at start: the reactor creates it, has the factory's
    /// [`build_datagram`](HandlerFactory::build_datagram) make its handler
    /// on its thread, and joins `plan.groups`. Waits for the reactor, which
    /// looks when idle and at least every few hundred busy passes, and
    /// returns the endpoint's id. A reactor holds at most 64 endpoints at
    /// once. The handler of an endpoint removed with
    /// [`Ctx::remove_datagram`](crate::reactor::Ctx::remove_datagram) is
    /// dropped on the reactor's thread; the others go to
    /// [`datagram_stopped`](HandlerFactory::datagram_stopped) when the
    /// reactor stops.
    ///
    /// Only threads that are no runtime's reactors may call it: a handler
    /// or the factory, on a reactor's thread, would wait while its reactor
    /// waits for it, or for another reactor that asks it.
    ///
    /// # Errors
    /// The reactor's or the factory's error when the endpoint cannot be
    /// made, or a group not joined (the endpoint is then removed, and its
    /// handler goes to `datagram_stopped`); [`Error::Runtime`] for a
    /// reactor the runtime does not have, one that stopped, a full arrival
    /// queue, and a call from a reactor's thread.
    pub fn add_datagram(&self, plan: DatagramPlan) -> Result<DatagramId> {
        let reactor = plan.reactor;
        if worker::on_reactor_thread() {
            return Err(Error::Runtime(
                "add_datagram from a runtime reactor's thread, which must not wait for a reactor"
                    .into(),
            ));
        }
        let (reply, answer) = std::sync::mpsc::sync_channel(1);
        self.shared.deliver(
            reactor,
            Arrival::Datagram(Box::new(DatagramArrival { plan, reply })),
        )?;
        answer.recv().unwrap_or_else(|_| {
            Err(Error::Runtime(format!(
                "reactor {reactor} stopped before it opened the datagram endpoint"
            )))
        })
    }

    /// Opens a submission ring from the calling thread to reactor
    /// `reactor`: see [`Submitter`].
    ///
    /// # Errors
    /// [`Error::Runtime`] when the reactor has stopped or its arrival queue
    /// is full.
    pub fn submitter(&self, reactor: usize) -> Result<Submitter> {
        let (producer, consumer) = submit::ring(
            self.shared.submit_ring,
            self.shared.submit_slot_size,
            self.shared.trace_clock.clone(),
        );
        self.shared.deliver(reactor, Arrival::Ring(consumer))?;
        Ok(Submitter::new(
            producer,
            Arc::clone(self.shared.port(reactor)?),
        ))
    }

    /// Stops every reactor (each drops its sessions, telling their peers
    /// goodbye) and every listener. [`Runtime::join`] then returns.
    pub fn stop(&self) {
        for port in &self.shared.ports {
            port.ask_to_stop();
        }
        self.stop_listeners();
    }

    /// Wakes every reactor for a pass, so the `on_idle` of its handlers
    /// that asked for it ([`Idle::Again`](crate::reactor::Idle::Again)) runs: for
    /// state shared across reactors (a handler on one reactor that must act
    /// on what a handler on another one posted). Costs one eventfd write
    /// per reactor, sleeping or not (a busy one runs an extra pass). Meant
    /// for phase boundaries, not per message. A handle kept by a handler or
    /// the factory keeps the runtime's shared state (its PD, CQ handles,
    /// listeners) alive until that handle is dropped: drop it when done.
    pub fn wake_all(&self) {
        for port in &self.shared.ports {
            if let Some(setup) = port.setup.get() {
                setup.waker.wake();
            }
        }
    }

    /// Stops reactor `reactor` only; new sessions go to the others.
    ///
    /// # Errors
    /// [`Error::Runtime`] for an index out of range.
    pub fn stop_reactor(&self, reactor: usize) -> Result<()> {
        self.shared.port(reactor)?.ask_to_stop();
        Ok(())
    }

    pub(super) fn stop_listeners(&self) {
        let listeners = self
            .shared
            .listeners
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        for listener in listeners.iter() {
            listener.shutdown();
        }
    }

    /// Handshakes in progress on the runtime's listeners (each ends within
    /// its handshake timeout): a server that stops after its last peer can
    /// let them end on their own first.
    pub fn pending_handshakes(&self) -> usize {
        let listeners = self
            .shared
            .listeners
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        listeners
            .iter()
            .map(ServerShutdown::pending_handshakes)
            .sum()
    }

    /// Each reactor's statistics, as last published.
    pub fn stats(&self) -> Vec<ReactorStats> {
        self.shared
            .ports
            .iter()
            .map(|port| port.snapshot())
            .collect()
    }

    /// How many sessions each reactor has been given and not yet dropped
    /// (handshakes in flight and queued sessions included).
    pub fn loads(&self) -> Vec<ReactorLoad> {
        self.shared.loads()
    }
}
