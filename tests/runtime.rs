//! The runtime: two pinned reactors serve several sessions placed by
//! policy, handlers built on their reactor's thread, stop and join, and the
//! statistics. Gated as in `tests/util/mod.rs`; the guest has 2 vCPUs, so
//! the reactors run in Blocking mode and the tests run one at a time.

mod util;

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc;
use std::time::Duration;

use rdma_comm_core::runtime::*;
use rdma_comm_core::session::PeerHello;
use rdma_comm_core::verbs::AccessFlags;
use util::runtime::*;
use util::*;

const CLIENTS: usize = 6;
const ROUND_TRIPS: u64 = 200;

fn two_reactors(policy: PlacementPolicy) -> RuntimeConfig {
    RuntimeConfig {
        reactors: 2,
        reactor: blocking(CLIENTS as u32),
        policy,
        ..RuntimeConfig::default()
    }
}

/// Sessions built per reactor, from the factory's reports.
fn built(events: &mpsc::Receiver<Event>, sessions: usize) -> HashMap<usize, Vec<String>> {
    let mut by_reactor: HashMap<usize, Vec<String>> = HashMap::new();
    let mut seen = 0;
    while seen < sessions {
        match events.recv_timeout(DEADLINE) {
            Ok(Event::Built { reactor, identity }) => {
                by_reactor.entry(reactor).or_default().push(identity);
                seen += 1;
            }
            Ok(Event::Established { .. }) => {}
            Err(err) => panic!("{seen} of {sessions} sessions were built: {err}"),
        }
    }
    by_reactor
}

verbs_test! {
    fn two_pinned_reactors_serve_sessions_placed_round_robin() {
        let _serial = serial();
        let ctx = open_device();
        let pd = ctx.alloc_pd().unwrap();
        let (tx, events) = mpsc::channel();
        let mut runtime = Runtime::start(&pd, two_reactors(PlacementPolicy::RoundRobin), echo_factory(tx)).unwrap();
        println!("{}", runtime.plan());
        let cores = runtime.plan().cores.clone();
        assert_eq!(cores.len(), 2);
        assert!(cores[0].is_some() && cores[0] != cores[1], "one core each: {cores:?}");
        let addr = runtime.serve("127.0.0.1:0", insecure(runtime.server_config(AccessFlags::empty()))).unwrap();

        let clients: Vec<_> = (0..CLIENTS)
            .map(|i| ping_client(addr, &format!("client-{i}"), ROUND_TRIPS, Duration::from_millis(300)))
            .collect();
        let by_reactor = built(&events, CLIENTS);
        assert_eq!(by_reactor.get(&0).map(Vec::len), Some(CLIENTS / 2), "{by_reactor:?}");
        assert_eq!(by_reactor.get(&1).map(Vec::len), Some(CLIENTS / 2), "{by_reactor:?}");
        for client in clients {
            assert_eq!(client.join().unwrap(), Ok(ROUND_TRIPS));
        }
        // The peers hung up: each reactor noticed through their control
        // connections (no timer) and removed the sessions.
        wait_until("the sessions to be removed", || {
            runtime.stats().iter().all(|s| s.sessions == 0)
                && runtime.loads().iter().all(|l| l.sessions == 0)
        });
        let stats = runtime.stats();
        for reactor in &stats {
            println!("{reactor}");
            let c = &reactor.counters;
            assert!(reactor.running);
            assert_eq!(reactor.core, cores[reactor.reactor]);
            assert!(reactor.thread_id > 0);
            assert!(c.messages >= ROUND_TRIPS * (CLIENTS / 2) as u64, "{reactor}");
            assert!(c.doorbells > 0 && c.requests >= c.doorbells && c.sleeps > 0, "{reactor}");
            assert!(c.completions >= c.messages && c.passes > c.empty_passes, "{reactor}");
            let idle = reactor.idle_fraction();
            assert!(idle > 0.0 && idle < 1.0, "{idle}");
        }
        runtime.stop();
        let last = runtime.join().unwrap();
        assert!(last.iter().all(|s| !s.running), "{last:?}");
        assert!(last[0].counters.messages >= stats[0].counters.messages);
    }
}

verbs_test! {
    fn a_placement_function_of_the_hello_decides_and_stopped_reactors_take_no_one() {
        let _serial = serial();
        let ctx = open_device();
        let pd = ctx.alloc_pd().unwrap();
        let (tx, events) = mpsc::channel();
        let by_identity: Arc<ChooseFn> = Arc::new(|hello: &PeerHello, loads: &[ReactorLoad]| {
            assert_eq!(loads.len(), 2);
            Some(usize::from(hello.identity.starts_with("bulk")))
        });
        let mut runtime = Runtime::start(&pd, two_reactors(PlacementPolicy::Custom(by_identity)), echo_factory(tx)).unwrap();
        let addr = runtime.serve("127.0.0.1:0", insecure(runtime.server_config(AccessFlags::empty()))).unwrap();
        let names = ["bulk-a", "rpc-a", "bulk-b", "rpc-b"];
        let clients: Vec<_> = names
            .iter()
            .map(|name| ping_client(addr, name, 50, Duration::ZERO))
            .collect();
        let mut by_reactor = built(&events, names.len());
        for identities in by_reactor.values_mut() {
            identities.sort();
        }
        assert_eq!(by_reactor[&1], vec!["bulk-a", "bulk-b"]);
        assert_eq!(by_reactor[&0], vec!["rpc-a", "rpc-b"]);
        for client in clients {
            assert_eq!(client.join().unwrap(), Ok(50));
        }

        // Reactor 1 stops: its peers are refused, the others still served.
        runtime.stop_reactor(1).unwrap();
        wait_until("reactor 1 to stop", || !runtime.stats()[1].running);
        let refused = ping_client(addr, "bulk-c", 10, Duration::ZERO).join().unwrap();
        assert!(refused.as_ref().is_err_and(|e| e.contains("rejected")), "{refused:?}");
        assert_eq!(ping_client(addr, "rpc-c", 10, Duration::ZERO).join().unwrap(), Ok(10));
        assert!(runtime.stop_reactor(2).is_err(), "there is no reactor 2");
        runtime.stop();
        runtime.join().unwrap();
    }
}

verbs_test! {
    fn clients_the_application_connects_are_adopted_by_the_least_loaded_reactor() {
        let _serial = serial();
        let ctx = open_device();
        let pd = ctx.alloc_pd().unwrap();
        let (tx, events) = mpsc::channel();
        let mut server = Runtime::start(&pd, two_reactors(PlacementPolicy::RoundRobin), echo_factory(tx)).unwrap();
        let addr = server.serve("127.0.0.1:0", insecure(server.server_config(AccessFlags::empty()))).unwrap();

        // A client runtime whose sessions the application connects itself.
        let (client_tx, client_events) = mpsc::channel();
        let client = Runtime::start(&pd, RuntimeConfig {
            reactors: 1,
            cores: CoreChoice::Unpinned,
            reactor: blocking(2),
            policy: PlacementPolicy::FewestSessions,
            ..RuntimeConfig::default()
        }, echo_factory(client_tx)).unwrap();
        let reactor = client.choose_reactor().unwrap();
        let spec = client.qp_spec(reactor, "rpc", AccessFlags::empty()).unwrap();
        let endpoint = rdma_comm_core::session::ClientSession::connect(
            addr, client.pd(), &rdma_comm_core::session::ClientConfig::new(vec![spec]),
        ).unwrap();
        client.adopt(reactor, endpoint).unwrap();
        assert!(matches!(client_events.recv_timeout(DEADLINE), Ok(Event::Built { reactor: 0, .. })));
        assert!(matches!(events.recv_timeout(DEADLINE), Ok(Event::Built { .. })));
        assert_eq!(client.loads()[0].sessions, 1);
        // A QP built elsewhere is refused by the reactor, not served.
        assert!(client.qp_spec(5, "x", AccessFlags::empty()).is_err());
        client.stop();
        client.join().unwrap();
        server.stop();
        server.join().unwrap();
    }
}

verbs_test! {
    fn asking_for_more_reactors_than_cores_is_a_clear_error() {
        let _serial = serial();
        let ctx = open_device();
        let pd = ctx.alloc_pd().unwrap();
        let (tx, _events) = mpsc::channel();
        let cores = std::thread::available_parallelism().unwrap().get();
        let config = RuntimeConfig {
            reactors: cores + 1,
            reactor: blocking(1),
            ..RuntimeConfig::default()
        };
        let err = Runtime::start(&pd, config, echo_factory(tx.clone())).unwrap_err().to_string();
        assert!(err.contains(&format!("{} reactors need {} cores", cores + 1, cores + 1)), "{err}");
        let config = RuntimeConfig {
            reactors: 2,
            cores: CoreChoice::List(vec![0, 0]),
            reactor: blocking(1),
            ..RuntimeConfig::default()
        };
        let err = Runtime::start(&pd, config, echo_factory(tx.clone())).unwrap_err().to_string();
        assert!(err.contains("core 0 is listed twice"), "{err}");
        // Submission rings whose slots would overflow (or exhaust) memory
        // are refused before anything is allocated.
        for (ring, slot) in [(2, 1usize << 63), (1 << 20, 1024), (1024, usize::MAX)] {
            let config = RuntimeConfig {
                reactors: 1,
                submit_ring: ring,
                submit_slot_size: slot,
                reactor: blocking(1),
                ..RuntimeConfig::default()
            };
            let err = Runtime::start(&pd, config, echo_factory(tx.clone())).unwrap_err().to_string();
            assert!(err.contains("submission rings hold at most"), "{ring} × {slot}: {err}");
        }
    }
}

/// Counts the handlers a stopping reactor hands back.
struct HandsBack<F> {
    inner: F,
    stopped: Arc<AtomicUsize>,
}

impl<F: HandlerFactory> HandlerFactory for HandsBack<F> {
    type Handler = F::Handler;

    fn build(&self, session: &NewSession<'_>) -> rdma_comm_core::Result<Self::Handler> {
        self.inner.build(session)
    }

    fn stopped(&self, _reactor: usize, handler: Self::Handler) {
        drop(handler);
        self.stopped.fetch_add(1, Ordering::AcqRel);
    }
}

verbs_test! {
    fn a_stopping_reactor_hands_its_sessions_handlers_back_to_the_factory() {
        let _serial = serial();
        let ctx = open_device();
        let pd = ctx.alloc_pd().unwrap();
        let (tx, events) = mpsc::channel();
        let stopped = Arc::new(AtomicUsize::new(0));
        let factory = HandsBack { inner: echo_factory(tx), stopped: Arc::clone(&stopped) };
        let mut runtime = Runtime::start(&pd, two_reactors(PlacementPolicy::RoundRobin), factory).unwrap();
        let addr = runtime.serve("127.0.0.1:0", insecure(runtime.server_config(AccessFlags::empty()))).unwrap();
        // Two clients that stay connected while the runtime stops.
        let clients: Vec<_> = ["a", "b"]
            .iter()
            .map(|id| ping_client(addr, id, 5, Duration::from_secs(5)))
            .collect();
        built(&events, 2);
        runtime.stop();
        runtime.join().unwrap();
        assert_eq!(stopped.load(Ordering::Acquire), 2, "both handlers came back");
        for client in clients {
            let _ = client.join().unwrap();
        }
    }
}
