//! A session whose peer stops answering: the failure the reactor hands the
//! handler names that peer (`Error::peer`), and the reactor's other
//! sessions keep running. Plus the QP settings the transport cannot carry,
//! refused when a QP is created. Gated as described in `tests/util/mod.rs`.
//!
//! The peer's QP is moved to the error state while its process, and so its
//! control connection, stays: only our QP's retries can notice, as when a
//! peer's host dies with requests in flight (`tools/faults kill-peer`
//! across guests), but within one kernel and in well under a second.

mod util;

use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use rdma_comm_core::Error;
use rdma_comm_core::reactor::*;
use rdma_comm_core::session::*;
use rdma_comm_core::verbs::*;
use util::reactor::*;
use util::*;

/// Hang guard of every wait (not a speed target).
const RUN_DEADLINE: Duration = Duration::from_secs(60);
/// Round trips the healthy session makes before the failure, and after it.
const BEFORE: u64 = 200;
const AFTER: u64 = 1_000;

/// What the failed session's handler was told.
#[derive(Debug, Clone)]
struct Told {
    peer: Option<SocketAddr>,
    status: Option<WcStatus>,
    qpn: Option<u32>,
    text: String,
}

/// The handler of the session whose peer went silent: it sends nothing
/// itself (the reactor's first credit update is the request in flight)
/// and records what it is told.
struct Watcher {
    told: Arc<Mutex<Vec<Told>>>,
    messages: Arc<Mutex<u64>>,
}

impl Handler for Watcher {
    fn on_message(&mut self, _: &mut Ctx<'_>, _: ConnId, _: &[u8], _: Option<u32>) {
        *self.messages.lock().unwrap() += 1;
    }

    fn on_error(&mut self, _: &mut Ctx<'_>, _: ConnId, error: &Error) {
        let qpn = match error {
            Error::Completion { qpn, .. } => Some(*qpn),
            _ => None,
        };
        self.told.lock().unwrap().push(Told {
            peer: error.peer(),
            status: error.completion_status(),
            qpn,
            text: error.to_string(),
        });
    }
}

fn config() -> ReactorConfig {
    ReactorConfig {
        slot_size: 2048,
        recv_depth: 64,
        send_slots: 64,
        signal_interval: 8,
        ..Default::default()
    }
}

/// Turns `reactor` until `done`, failing the test at the deadline.
#[track_caller]
fn run_until(reactor: &mut Reactor<BoxedHandler>, what: &str, mut done: impl FnMut() -> bool) {
    let start = Instant::now();
    while !done() {
        reactor.turn().expect("reactor pass");
        assert!(
            start.elapsed() < RUN_DEADLINE,
            "timed out after {RUN_DEADLINE:?} waiting for {what}"
        );
    }
}

verbs_test! {
    fn a_peer_that_stops_answering_is_named_and_the_other_session_runs_on() {
        let ctx = open_device();
        let pd = ctx.alloc_pd().unwrap();
        let mut reactor: Reactor<BoxedHandler> = Reactor::new(&pd, config()).unwrap();

        // The healthy session: a verifying ping-pong with both ends on this
        // reactor, with no limit it could reach here.
        let (ping, echo) = add_ping_pong(&pd, Sides::One(&mut reactor), u64::MAX, 64, true);
        run_until(&mut reactor, "the ping-pong to get going", || {
            ping.done.load(Ordering::Relaxed) >= BEFORE
        });

        // The other session: our QP with a short retry window (nominally
        // (1 + 1) x 4.096 us x 2^12 = 34 ms), its peer a QP no reactor
        // serves, moved to the error state before we send anything: it
        // drops what arrives and acknowledges nothing.
        let listener = ServerSession::bind(
            "127.0.0.1:0",
            &pd,
            ServerConfig {
                max_peers: Some(1),
                ..ServerConfig::insecure_open()
            },
        )
        .expect("bind");
        let mut spec = reactor.qp_spec("silent");
        spec.qp.timeout = 12;
        spec.qp.retry_cnt = 1;
        let ours = ClientSession::connect(listener.local_addr(), &pd, &ClientConfig::new(vec![spec]))
            .expect("connect");
        let theirs = listener.accept_timeout(DEADLINE).expect("accept");
        let (our_qpn, peer) = (ours.qps()[0].qp().qpn(), ours.peer());
        assert_eq!(peer, listener.local_addr(), "a client session's peer is the server");
        theirs.qps()[0].qp().set_error().expect("the peer's QP to the error state");
        let told = Arc::new(Mutex::new(Vec::new()));
        let messages = Arc::new(Mutex::new(0));
        let watcher = Watcher {
            told: Arc::clone(&told),
            messages: Arc::clone(&messages),
        };
        reactor.add(ours, Box::new(watcher)).expect("add the silent peer's session");
        let failed_at = Instant::now();
        run_until(&mut reactor, "the silent peer's failure", || {
            !told.lock().unwrap().is_empty()
        });
        let detected = failed_at.elapsed();
        let at_failure = ping.done.load(Ordering::Relaxed);

        // The healthy session goes on, every message verified.
        run_until(&mut reactor, "the ping-pong after the failure", || {
            ping.done.load(Ordering::Relaxed) >= at_failure + AFTER
        });
        let told = told.lock().unwrap().clone();
        eprintln!(
            "the silent peer's failure after {detected:?}: {}; the other session: {} round trips before it, {} in all",
            told[0].text,
            at_failure,
            ping.done.load(Ordering::Relaxed)
        );
        assert_eq!(told.len(), 1, "the handler is told once: {told:?}");
        let failure = &told[0];
        assert_eq!(failure.peer, Some(peer), "Error::peer() names the peer: {}", failure.text);
        assert!(
            failure.text.contains(&peer.to_string()),
            "the message names the peer: {}",
            failure.text
        );
        assert_eq!(
            failure.status,
            Some(WcStatus::RETRY_EXC_ERR),
            "the QP's retries ran out: {}",
            failure.text
        );
        assert_eq!(failure.qpn, Some(our_qpn), "the error names our QP: {}", failure.text);
        assert_eq!(*messages.lock().unwrap(), 0, "the silent peer sent nothing");
        for (what, outcome) in [("pinger", &ping), ("echoer", &echo)] {
            assert_eq!(outcome.errors.load(Ordering::Relaxed), 0, "{what}: errors");
            assert_eq!(outcome.bad.load(Ordering::Relaxed), 0, "{what}: corrupted messages");
        }
        assert!(
            echo.done.load(Ordering::Relaxed) >= at_failure + AFTER,
            "the echoer verified every message"
        );
        drop(theirs);
    }
}

verbs_test! {
    fn a_qp_with_settings_the_wire_cannot_carry_is_not_created() {
        let ctx = open_device();
        let pd = ctx.alloc_pd().unwrap();
        let cq = ctx.create_cq(16, None).unwrap();
        type Field = fn(&mut QpConfig) -> &mut u8;
        let fields: [(&str, u8, Field); 4] = [
            ("timeout", 31, |c| &mut c.timeout),
            ("retry_cnt", 7, |c| &mut c.retry_cnt),
            ("rnr_retry", 7, |c| &mut c.rnr_retry),
            ("min_rnr_timer", 31, |c| &mut c.min_rnr_timer),
        ];
        for (name, max, field) in fields {
            let mut config = QpConfig::default();
            *field(&mut config) = max;
            let mut qp = pd.create_qp(&cq, &cq, &config).unwrap_or_else(|err| panic!("{name} = {max}: {err}"));
            // Connected to itself: the settings reach ibv_modify_qp(RTS).
            let own = qp.endpoint();
            qp.connect(&own).unwrap_or_else(|err| panic!("{name} = {max}: {err}"));
            *field(&mut config) = max + 1;
            match pd.create_qp(&cq, &cq, &config) {
                Err(Error::QpConfigOutOfRange { field, value, max: limit }) => {
                    assert_eq!((field, value, limit), (name, max + 1, max));
                }
                Err(other) => panic!("{name} = {}: not QpConfigOutOfRange: {other}", max + 1),
                Ok(_) => panic!("{name} = {} was accepted", max + 1),
            }
        }
    }
}
