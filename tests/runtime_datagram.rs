//! Datagram endpoints on a runtime's reactors (`RuntimeConfig::datagrams`):
//! a reactor opens its endpoint and joins a multicast group before it
//! serves anything (or its handler joins from a callback, `Ctx::join`, or
//! the endpoint is opened once the runtime runs, `RuntimeHandle::add_datagram`),
//! its handler (built on its thread by the factory) takes every datagram a
//! publisher sends to the group, and comes back to the factory when the
//! runtime stops; asked from a reactor's thread (by a handler, or by the
//! factory as it builds one), the runtime refuses at once; a factory that
//! builds no datagram handlers, or a plan for a reactor the runtime does
//! not have, stops the runtime from starting. Gated as in
//! `tests/util/mod.rs`: runs in the Soft-RoCE guest.

mod util;

use std::net::Ipv4Addr;
use std::rc::Rc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use rdma_comm_core::Error;
use rdma_comm_core::reactor::*;
use rdma_comm_core::runtime::*;
use rdma_comm_core::verbs::*;
use util::runtime::*;
use util::*;

/// Datagrams the publisher sends.
const DATAGRAMS: u64 = 300;
/// Most datagrams in flight to the subscriber: within its receive ring.
const AHEAD: u64 = 32;

fn group() -> Gid {
    Gid::from_ipv4(Ipv4Addr::new(239, 1, 2, 5))
}

/// The subscriber on a runtime reactor: counts the datagrams that carry
/// the next number in order (its count shared with the test, which paces
/// the publisher by it), and those that do not.
struct Subscriber {
    /// Not `Send`: the factory builds it on its reactor's thread.
    reactor: Rc<usize>,
    in_order: Arc<AtomicU64>,
    out_of_order: u64,
    /// The endpoint it was built for.
    id: Option<DatagramId>,
    /// The endpoint, and a group to join from the first `on_idle`.
    join: Option<(DatagramId, Gid)>,
    joined: Arc<AtomicU64>,
    /// Asks reactor 0 for an endpoint from its first `on_idle`, and
    /// says how that went.
    ask_other: Option<AskOther>,
}

/// A handle to ask the reactor for an endpoint with, and where to say how
/// that went.
type AskOther = (RuntimeHandle, mpsc::Sender<String>);

impl Handler for Subscriber {
    fn on_message(&mut self, _: &mut Ctx<'_>, _: ConnId, _: &[u8], _: Option<u32>) {}

    fn on_idle(&mut self, ctx: &mut Ctx<'_>) -> Idle {
        if let Some((id, group)) = self.join.take() {
            ctx.join(id, group).expect("joined from a callback");
            self.joined.store(1, Ordering::Release);
        }
        if let Some((handle, told)) = self.ask_other.take() {
            // Another reactor than its own: no reactor's thread may wait
            // for one.
            let _ = told.send(tell(handle.add_datagram(plan(0, false))));
        }
        Idle::Again
    }

    fn on_datagram(&mut self, _: &mut Ctx<'_>, _: DatagramId, _: &DatagramSource<'_>, data: &[u8]) {
        let next = self.in_order.load(Ordering::Relaxed);
        if data == next.to_le_bytes() {
            self.in_order.store(next + 1, Ordering::Relaxed);
        } else {
            self.out_of_order += 1;
        }
    }
}

/// How asking a reactor for an endpoint went, for the test to read.
fn tell(asked: rdma_comm_core::Result<DatagramId>) -> String {
    match asked {
        Ok(id) => format!("opened {id:?}"),
        Err(err) => err.to_string(),
    }
}

/// Builds subscribers for datagram endpoints and refuses sessions; hands
/// the subscribers that come back to the test.
struct Feed {
    in_order: Arc<AtomicU64>,
    /// Join the group from the handler's first `on_idle`, not at start.
    join_later: bool,
    joined: Arc<AtomicU64>,
    /// Set once running: the next handler built asks reactor 0 for an
    /// endpoint, and says how that went here.
    ask_other: Arc<Mutex<Option<AskOther>>>,
    /// Set once running: the factory asks reactor 0 for an endpoint while
    /// it builds the next datagram handler (on its reactor's thread), and
    /// says how that went here.
    factory_asks: Arc<Mutex<Option<AskOther>>>,
    built: mpsc::Sender<(usize, u32)>,
    back: mpsc::Sender<(usize, u64, u64)>,
}

impl Feed {
    /// A factory that tells `built` of each handler it builds and `back`
    /// of each that comes back; its subscribers join at start.
    fn new(built: mpsc::Sender<(usize, u32)>, back: mpsc::Sender<(usize, u64, u64)>) -> Self {
        Self {
            in_order: Arc::default(),
            join_later: false,
            joined: Arc::default(),
            ask_other: Arc::default(),
            factory_asks: Arc::default(),
            built,
            back,
        }
    }
}

impl HandlerFactory for Feed {
    type Handler = Subscriber;

    fn build(&self, _: &NewSession<'_>) -> rdma_comm_core::Result<Subscriber> {
        Err(Error::InvalidArgument("this runtime serves no sessions"))
    }

    fn build_datagram(&self, datagram: &NewDatagram<'_>) -> rdma_comm_core::Result<Subscriber> {
        if let Some((handle, told)) = self.factory_asks.lock().unwrap().take() {
            let _ = told.send(tell(handle.add_datagram(plan(0, false))));
        }
        let _ = self.built.send((datagram.reactor, datagram.qp.qpn()));
        Ok(Subscriber {
            reactor: Rc::new(datagram.reactor),
            in_order: Arc::clone(&self.in_order),
            out_of_order: 0,
            id: Some(datagram.id),
            join: self.join_later.then_some((datagram.id, group())),
            joined: Arc::clone(&self.joined),
            ask_other: self.ask_other.lock().unwrap().take(),
        })
    }

    fn stopped(&self, _: usize, _: Subscriber) {
        panic!("no session was served: only the endpoint's handler comes back");
    }

    fn datagram_stopped(&self, reactor: usize, id: DatagramId, handler: Subscriber) {
        assert_eq!(
            (*handler.reactor, Some(id)),
            (reactor, handler.id),
            "back from the reactor and endpoint it was built for"
        );
        let _ = self.back.send((
            reactor,
            handler.in_order.load(Ordering::Relaxed),
            handler.out_of_order,
        ));
    }
}

/// Sends numbered datagrams to the group from `on_idle`, at most `AHEAD`
/// beyond what the subscriber has taken.
struct Publisher {
    to: UdDestination,
    sent: u64,
    taken: Arc<AtomicU64>,
    id: Option<DatagramId>,
}

impl Handler for Publisher {
    fn on_message(&mut self, _: &mut Ctx<'_>, _: ConnId, _: &[u8], _: Option<u32>) {}

    fn on_idle(&mut self, ctx: &mut Ctx<'_>) -> Idle {
        let Some(id) = self.id else {
            return Idle::Again;
        };
        let taken = self.taken.load(Ordering::Relaxed);
        if taken >= DATAGRAMS {
            ctx.stop();
            return Idle::Again;
        }
        while self.sent < DATAGRAMS && self.sent < taken + AHEAD {
            if ctx
                .send_datagram(id, &self.to, &self.sent.to_le_bytes())
                .is_err()
            {
                break;
            }
            self.sent += 1;
        }
        Idle::Again
    }
}

fn one_subscriber(reactors: usize, on: usize, join_later: bool) -> RuntimeConfig {
    RuntimeConfig {
        reactors,
        reactor: blocking(1),
        datagrams: vec![plan(on, join_later)],
        ..RuntimeConfig::default()
    }
}

/// The subscriber's endpoint on reactor `on`, joined to the group at once
/// unless its handler joins it later.
fn plan(on: usize, join_later: bool) -> DatagramPlan {
    DatagramPlan {
        reactor: on,
        config: UdConfig::default(),
        groups: if join_later { vec![] } else { vec![group()] },
    }
}

/// When the subscriber's endpoint is opened and joined.
#[derive(Clone, Copy, PartialEq)]
enum Subscribe {
    /// Opened and joined as the reactor starts.
    AtStart,
    /// Opened at start, joined from its handler's first `on_idle`.
    JoinFromCallback,
    /// Opened and joined once the runtime runs.
    OnceRunning,
}

/// A runtime whose reactor 1 subscribes to the group as `how` says, fed
/// by a publisher on a reactor of the test's own.
fn subscribe_and_publish(how: Subscribe) {
    let join_later = how == Subscribe::JoinFromCallback;
    let ctx = open_device();
    let pd = ctx.alloc_pd().unwrap();
    let in_order = Arc::new(AtomicU64::new(0));
    let joined = Arc::new(AtomicU64::new(0));
    let (built_tx, built) = mpsc::channel();
    let (back_tx, back) = mpsc::channel();
    let factory_ask_other = Arc::default();
    let factory_asks = Arc::default();
    let factory = Feed {
        in_order: Arc::clone(&in_order),
        join_later,
        joined: Arc::clone(&joined),
        ask_other: Arc::clone(&factory_ask_other),
        factory_asks: Arc::clone(&factory_asks),
        ..Feed::new(built_tx, back_tx)
    };
    let mut config = one_subscriber(2, 1, join_later);
    if how == Subscribe::OnceRunning {
        config.datagrams.clear();
    }
    let runtime = Runtime::start(&pd, config, factory).expect("the runtime");
    let mut own_thread = None;
    if how == Subscribe::OnceRunning {
        assert!(built.try_recv().is_err(), "nothing planned at start");
        let handle = runtime.handle();
        let (told, asked) = mpsc::channel();
        *factory_ask_other.lock().unwrap() = Some((handle.clone(), told.clone()));
        *factory_asks.lock().unwrap() = Some((handle.clone(), told));
        own_thread = Some(asked);
        handle
            .add_datagram(plan(1, false))
            .expect("opened on reactor 1");
        assert!(
            handle.add_datagram(plan(2, false)).is_err(),
            "a reactor the runtime does not have"
        );
    }
    let (reactor, qpn) = built.try_recv().expect("built before start returned");
    assert_eq!(reactor, 1, "on the reactor its plan names");
    assert!(qpn > 0);
    let start = Instant::now();
    while join_later && joined.load(Ordering::Acquire) == 0 {
        assert!(start.elapsed() < DEADLINE, "the handler never joined");
        std::thread::sleep(std::time::Duration::from_millis(1));
    }

    // A publisher on a reactor of the test's own.
    let mut publisher = Reactor::<Publisher>::new(&pd, ReactorConfig::default()).unwrap();
    let id = publisher
        .add_datagram(&UdConfig::default(), |_, qp| {
            Ok(Publisher {
                to: qp.group_destination(group())?,
                sent: 0,
                taken: Arc::clone(&in_order),
                id: None,
            })
        })
        .expect("the publisher's endpoint");
    publisher.datagram_handler_mut(id).unwrap().id = Some(id);
    while in_order.load(Ordering::Relaxed) < DATAGRAMS {
        assert!(
            start.elapsed() < DEADLINE,
            "{} of {DATAGRAMS} arrived",
            in_order.load(Ordering::Relaxed)
        );
        publisher.turn().expect("a publisher pass");
    }
    // The reactor publishes its counters after the pass whose handler
    // took the last datagram: they may lag the handler by that pass.
    loop {
        let stats = runtime.stats();
        if stats[1].counters.datagrams >= DATAGRAMS {
            break;
        }
        assert!(
            start.elapsed() < DEADLINE,
            "counted on reactor 1: {:?}",
            stats[1].counters
        );
        std::thread::sleep(std::time::Duration::from_millis(1));
    }

    if let Some(asked) = own_thread {
        // The factory asked while building the handler, and the handler
        // from `on_idle`: both refused at once, neither waits for a reactor.
        for who in ["the factory", "the handler"] {
            let told = asked
                .recv_timeout(DEADLINE)
                .unwrap_or_else(|_| panic!("{who} asked reactor 0"));
            assert!(told.contains("reactor's thread"), "{who}: {told}");
        }
    }
    runtime.stop();
    runtime.join().expect("joined");
    let (reactor, taken, out_of_order) = back.try_recv().expect("the subscriber came back");
    assert_eq!((reactor, taken, out_of_order), (1, DATAGRAMS, 0));
    assert!(back.try_recv().is_err(), "one endpoint, one handler");
}

verbs_test! {
    fn a_running_runtime_opens_an_endpoint_that_takes_a_groups_datagrams() {
        let _serial = serial();
        subscribe_and_publish(Subscribe::OnceRunning);
    }
}

verbs_test! {
    fn an_endpoint_that_cannot_join_or_is_asked_of_a_stopped_reactor_is_refused() {
        let _serial = serial();
        let ctx = open_device();
        let pd = ctx.alloc_pd().unwrap();
        let (built_tx, built) = mpsc::channel();
        let (back_tx, back) = mpsc::channel();
        let factory = Feed::new(built_tx, back_tx);
        let mut config = one_subscriber(1, 0, false);
        config.datagrams.clear();
        let runtime = Runtime::start(&pd, config, factory).expect("the runtime");
        let handle = runtime.handle();
        // A group that is no multicast address: the endpoint is made, its
        // join fails, and it is removed again with its handler handed back.
        let unicast = DatagramPlan {
            groups: vec![Gid::from_ipv4(Ipv4Addr::new(10, 1, 2, 3))],
            ..plan(0, false)
        };
        let refused = handle.add_datagram(unicast).expect_err("no multicast group");
        assert!(refused.to_string().contains("multicast"), "{refused}");
        assert!(built.try_recv().is_ok(), "its handler was built");
        assert_eq!(back.try_recv().ok(), Some((0, 0, 0)), "and came back at once");
        runtime.stop();
        runtime.join().expect("joined");
        assert!(back.try_recv().is_err(), "no other endpoint");
        let refused = handle.add_datagram(plan(0, false)).expect_err("the reactor stopped");
        assert!(refused.to_string().contains("stopped"), "{refused}");
        assert!(built.try_recv().is_err(), "no handler built for a stopped reactor");
    }
}

verbs_test! {
    fn a_runtime_reactor_takes_a_groups_datagrams_on_its_endpoint() {
        let _serial = serial();
        subscribe_and_publish(Subscribe::AtStart);
    }
}

verbs_test! {
    fn a_runtime_endpoints_handler_joins_a_group_from_a_callback() {
        let _serial = serial();
        subscribe_and_publish(Subscribe::JoinFromCallback);
    }
}

verbs_test! {
    fn a_runtime_whose_datagram_plans_cannot_be_served_does_not_start() {
        let _serial = serial();
        let ctx = open_device();
        let pd = ctx.alloc_pd().unwrap();
        // A factory of sessions only: it builds no datagram handler.
        let sessions_only = |_: &NewSession<'_>| Ok::<_, Error>(Subscriber {
            reactor: Rc::new(0),
            in_order: Arc::new(AtomicU64::new(0)),
            out_of_order: 0,
            id: None,
            join: None,
            joined: Arc::new(AtomicU64::new(0)),
            ask_other: None,
        });
        match Runtime::start(&pd, one_subscriber(1, 0, false), sessions_only) {
            Err(err) => assert!(err.to_string().contains("build_datagram"), "{err}"),
            Ok(_) => panic!("started without datagram handlers"),
        }
        let (built_tx, built) = mpsc::channel();
        let (back_tx, _back) = mpsc::channel();
        let factory = Feed::new(built_tx, back_tx);
        match Runtime::start(&pd, one_subscriber(1, 1, false), factory) {
            Err(err) => assert!(err.to_string().contains("reactor 1 of 1"), "{err}"),
            Ok(_) => panic!("started with a plan for reactor 1 of 1"),
        }
        assert!(built.try_recv().is_err(), "checked before any reactor started");
    }
}
