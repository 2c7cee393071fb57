//! Reactor test handlers: a verifying ping-pong pair and a verifying stream
//! pair, plus helpers that connect them in either thread mode. The handlers
//! allocate nothing after construction, so the allocation test can use them.
#![allow(dead_code)]

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::thread;
use std::time::Duration;

use rdma_comm_core::Error;
use rdma_comm_core::reactor::*;
use rdma_comm_core::session::*;
use rdma_comm_core::verbs::*;

use super::insecure;

pub type BoxedHandler = Box<dyn Handler + Send>;

/// The byte at `i` of message `seq`.
#[inline]
pub fn byte(seq: u64, i: usize) -> u8 {
    (seq.wrapping_mul(0x9e37_79b9).wrapping_add(i as u64 * 131) >> 5) as u8
}

pub fn fill(buf: &mut [u8], seq: u64) {
    for (i, b) in buf.iter_mut().enumerate() {
        *b = byte(seq, i);
    }
}

pub fn matches(buf: &[u8], seq: u64) -> bool {
    buf.iter().enumerate().all(|(i, &b)| b == byte(seq, i))
}

/// Shared outcome counters (atomics: no locks, no allocation).
#[derive(Default, Debug)]
pub struct Outcome {
    /// Round trips the pinger should reach before stopping the reactor.
    pub limit: AtomicU64,
    pub done: AtomicU64,
    pub bad: AtomicU64,
    pub errors: AtomicU64,
    pub finished: AtomicBool,
}

/// Alternates SEND and WRITE_WITH_IMM pings and checks every echo.
pub struct Pinger {
    pub size: usize,
    seq: u64,
    pending: bool,
    conn: Option<ConnId>,
    source: MemoryRegion,
    inbox: Arc<MemoryRegion>,
    peer_inbox: RemoteRegion,
    scratch: Vec<u8>,
    pub outcome: Arc<Outcome>,
    /// Only SEND (no WRITE_WITH_IMM) when false.
    pub use_write_imm: bool,
}

impl Pinger {
    pub fn new(
        iters: u64,
        size: usize,
        source: MemoryRegion,
        inbox: Arc<MemoryRegion>,
        peer_inbox: RemoteRegion,
        outcome: Arc<Outcome>,
    ) -> Self {
        outcome.limit.store(iters, Ordering::Relaxed);
        Self {
            size,
            seq: 0,
            pending: false,
            conn: None,
            source,
            inbox,
            peer_inbox,
            scratch: vec![0; size],
            outcome,
            use_write_imm: true,
        }
    }

    fn ping(&mut self, ctx: &mut Ctx<'_>, conn: ConnId) {
        let seq = self.seq;
        let size = self.size;
        let result = if !self.use_write_imm || seq.is_multiple_of(2) {
            ctx.send_with(conn, size, Some(seq as u32), |buf| fill(buf, seq))
        } else {
            fill(&mut self.scratch, seq);
            self.source.write(0, &self.scratch).expect("source region");
            let local = self.source.slice(0, size).expect("source slice");
            ctx.write(
                conn,
                &local,
                self.peer_inbox.slice(0, size as u64).expect("peer inbox"),
                Some(seq as u32),
            )
        };
        self.pending = matches!(result, Err(SendError::WouldBlock));
        if let Err(err) = result
            && !self.pending
        {
            panic!("ping {seq} failed: {err}");
        }
    }

    fn answered(&mut self, ctx: &mut Ctx<'_>, conn: ConnId, ok: bool) {
        if !ok {
            self.outcome.bad.fetch_add(1, Ordering::Relaxed);
        }
        self.seq += 1;
        self.outcome.done.store(self.seq, Ordering::Relaxed);
        if self.seq >= self.outcome.limit.load(Ordering::Relaxed) {
            self.outcome.finished.store(true, Ordering::Release);
            ctx.stop();
        } else {
            self.ping(ctx, conn);
        }
    }
}

impl Handler for Pinger {
    fn on_established(&mut self, ctx: &mut Ctx<'_>, conn: ConnId) {
        self.conn = Some(conn);
        self.ping(ctx, conn);
    }

    fn on_message(&mut self, ctx: &mut Ctx<'_>, conn: ConnId, data: &[u8], imm: Option<u32>) {
        let ok = imm == Some(self.seq as u32) && data.len() == self.size && matches(data, self.seq);
        self.answered(ctx, conn, ok);
    }

    fn on_write_imm(&mut self, ctx: &mut Ctx<'_>, conn: ConnId, imm: u32, len: u32) {
        let ok = imm == self.seq as u32
            && len as usize == self.size
            && self.inbox.read(0, &mut self.scratch).is_ok()
            && matches(&self.scratch, self.seq);
        self.answered(ctx, conn, ok);
    }

    fn on_error(&mut self, ctx: &mut Ctx<'_>, _conn: ConnId, error: &Error) {
        eprintln!("pinger: {error}");
        self.outcome.errors.fetch_add(1, Ordering::Relaxed);
        ctx.stop();
    }

    fn on_idle(&mut self, ctx: &mut Ctx<'_>) -> Idle {
        // Resume after a WouldBlock, or after the limit was raised.
        let resumed = self.outcome.finished.load(Ordering::Acquire)
            && self.seq < self.outcome.limit.load(Ordering::Relaxed);
        if resumed {
            self.outcome.finished.store(false, Ordering::Release);
        }
        if let Some(conn) = self.conn
            && (self.pending || resumed)
        {
            self.ping(ctx, conn);
        }
        Idle::Again
    }
}

/// Echoes SENDs by SEND and WRITE_WITH_IMMs by WRITE_WITH_IMM from its inbox.
pub struct Echoer {
    inbox: Arc<MemoryRegion>,
    peer_inbox: Option<RemoteRegion>,
    scratch: Vec<u8>,
    pub outcome: Arc<Outcome>,
}

impl Echoer {
    pub fn new(
        inbox: Arc<MemoryRegion>,
        peer_inbox: Option<RemoteRegion>,
        max: usize,
        outcome: Arc<Outcome>,
    ) -> Self {
        Self {
            inbox,
            peer_inbox,
            scratch: vec![0; max],
            outcome,
        }
    }
}

impl Handler for Echoer {
    fn on_message(&mut self, ctx: &mut Ctx<'_>, conn: ConnId, data: &[u8], imm: Option<u32>) {
        if !imm.is_some_and(|seq| matches(data, u64::from(seq))) {
            self.outcome.bad.fetch_add(1, Ordering::Relaxed);
        }
        if ctx.send(conn, data, imm).is_err() {
            self.outcome.errors.fetch_add(1, Ordering::Relaxed);
        }
        self.outcome.done.fetch_add(1, Ordering::Relaxed);
    }

    fn on_write_imm(&mut self, ctx: &mut Ctx<'_>, conn: ConnId, imm: u32, len: u32) {
        let len = len as usize;
        let scratch = &mut self.scratch[..len];
        if self.inbox.read(0, scratch).is_err() || !matches(scratch, u64::from(imm)) {
            self.outcome.bad.fetch_add(1, Ordering::Relaxed);
        }
        let peer = self.peer_inbox.expect("the pinger exported an inbox");
        let local = self.inbox.slice(0, len).expect("inbox slice");
        if ctx
            .write(
                conn,
                &local,
                peer.slice(0, len as u64).expect("peer inbox"),
                Some(imm),
            )
            .is_err()
        {
            self.outcome.errors.fetch_add(1, Ordering::Relaxed);
        }
        self.outcome.done.fetch_add(1, Ordering::Relaxed);
    }

    fn on_error(&mut self, _ctx: &mut Ctx<'_>, _conn: ConnId, error: &Error) {
        eprintln!("echoer: {error}");
        self.outcome.errors.fetch_add(1, Ordering::Relaxed);
    }
}

/// Streams `total` messages of varying size, as fast as credits allow.
pub struct Streamer {
    pub total: u64,
    pub max: usize,
    sent: u64,
    completed: u64,
    conn: Option<ConnId>,
    pub outcome: Arc<Outcome>,
    /// Stop the reactor once every send completed (per-QP thread mode).
    pub stop_when_done: bool,
}

/// The length of stream message `seq`: 1 byte up to `max`, never a multiple pattern.
pub fn stream_len(seq: u64, max: usize) -> usize {
    1 + (seq.wrapping_mul(7919) % max as u64) as usize
}

impl Streamer {
    pub fn new(total: u64, max: usize, outcome: Arc<Outcome>) -> Self {
        Self {
            total,
            max,
            sent: 0,
            completed: 0,
            conn: None,
            outcome,
            stop_when_done: false,
        }
    }

    fn pump(&mut self, ctx: &mut Ctx<'_>) {
        let Some(conn) = self.conn else { return };
        while self.sent < self.total {
            let seq = self.sent;
            let len = stream_len(seq, self.max);
            match ctx.send_with(conn, len, Some(seq as u32), |buf| fill(buf, seq)) {
                Ok(_) => self.sent += 1,
                Err(SendError::WouldBlock) => break,
                Err(err) => panic!("stream send {seq}: {err}"),
            }
        }
    }
}

impl Handler for Streamer {
    fn on_established(&mut self, ctx: &mut Ctx<'_>, conn: ConnId) {
        self.conn = Some(conn);
        self.pump(ctx);
    }

    fn on_message(&mut self, _ctx: &mut Ctx<'_>, _conn: ConnId, _data: &[u8], _imm: Option<u32>) {
        self.outcome.bad.fetch_add(1, Ordering::Relaxed);
    }

    fn on_send_complete(&mut self, ctx: &mut Ctx<'_>, _conn: ConnId, _seq: u32) {
        self.completed += 1;
        self.outcome.done.store(self.completed, Ordering::Relaxed);
        if self.completed == self.total && self.stop_when_done {
            ctx.stop();
        }
        self.pump(ctx);
    }

    fn on_error(&mut self, ctx: &mut Ctx<'_>, _conn: ConnId, error: &Error) {
        eprintln!("streamer: {error}");
        self.outcome.errors.fetch_add(1, Ordering::Relaxed);
        ctx.stop();
    }

    /// Credits come back with the receiver's credit updates, which no
    /// other callback of this handler's reports: it has no `on_idle`, so a
    /// wakeup the reactor missed would stall the stream.
    fn on_writable(&mut self, ctx: &mut Ctx<'_>, _conn: ConnId) {
        self.pump(ctx);
    }
}

/// Receives a stream and checks order, length and content of every message;
/// with `slow`, it sleeps now and then, like a receiver that cannot keep up.
pub struct Sink {
    pub total: u64,
    pub max: usize,
    expected: u64,
    pub slow: Option<Duration>,
    pub outcome: Arc<Outcome>,
}

impl Sink {
    pub fn new(total: u64, max: usize, outcome: Arc<Outcome>) -> Self {
        Self {
            total,
            max,
            expected: 0,
            slow: None,
            outcome,
        }
    }
}

impl Handler for Sink {
    fn on_message(&mut self, ctx: &mut Ctx<'_>, _conn: ConnId, data: &[u8], imm: Option<u32>) {
        let seq = self.expected;
        let ok = imm == Some(seq as u32)
            && data.len() == stream_len(seq, self.max)
            && matches(data, seq);
        if !ok {
            self.outcome.bad.fetch_add(1, Ordering::Relaxed);
        }
        self.expected += 1;
        self.outcome.done.store(self.expected, Ordering::Relaxed);
        if let Some(pause) = self.slow
            && self.expected.is_multiple_of(256)
        {
            thread::sleep(pause);
        }
        if self.expected == self.total {
            self.outcome.finished.store(true, Ordering::Release);
            ctx.stop();
        }
    }

    fn on_error(&mut self, ctx: &mut Ctx<'_>, _conn: ConnId, error: &Error) {
        eprintln!("sink: {error}");
        self.outcome.errors.fetch_add(1, Ordering::Relaxed);
        ctx.stop();
    }
}

/// The reactor(s) a test connects: one playing both sides (shared CQ), or one
/// per side (one QP per reactor).
pub enum Sides<'a> {
    One(&'a mut Reactor<BoxedHandler>),
    Two {
        server: &'a mut Reactor<BoxedHandler>,
        client: &'a mut Reactor<BoxedHandler>,
    },
}

impl Sides<'_> {
    pub fn server(&mut self) -> &mut Reactor<BoxedHandler> {
        match self {
            Sides::One(reactor) => reactor,
            Sides::Two { server, .. } => server,
        }
    }

    pub fn client(&mut self) -> &mut Reactor<BoxedHandler> {
        match self {
            Sides::One(reactor) => reactor,
            Sides::Two { client, .. } => client,
        }
    }
}

/// Connects a client endpoint built on the client reactor to a server
/// endpoint built on the server reactor. Each side exports `inbox` as
/// "inbox"; returns (server endpoint, client endpoint).
pub fn connect(
    pd: &ProtectionDomain,
    sides: &mut Sides<'_>,
    server_inbox: &Arc<MemoryRegion>,
    client_inbox: &Arc<MemoryRegion>,
) -> (Endpoint, Endpoint) {
    let mut config = insecure(sides.server().server_config(AccessFlags::REMOTE_WRITE));
    let export = Arc::clone(server_inbox);
    config.exports = Some(Arc::new(move |_, _: &ProtectionDomain| {
        Ok(vec![Export::new(
            1,
            "inbox",
            &export,
            AccessFlags::REMOTE_WRITE,
        )])
    }));
    config.max_peers = Some(1);
    let listener = ServerSession::bind("127.0.0.1:0", pd, config).expect("bind");
    let spec = sides
        .client()
        .qp_spec_with_access("data", AccessFlags::REMOTE_WRITE);
    let client_config = ClientConfig::new(vec![spec]).with_exports(vec![Export::new(
        1,
        "inbox",
        client_inbox,
        AccessFlags::REMOTE_WRITE,
    )]);
    let client_ep =
        ClientSession::connect(listener.local_addr(), pd, &client_config).expect("connect");
    let server_ep = listener
        .accept_timeout(Duration::from_secs(30))
        .expect("accept");
    (server_ep, client_ep)
}

/// Regions a ping-pong side needs: an inbox others write into and a source.
pub fn regions(pd: &ProtectionDomain, size: usize) -> (Arc<MemoryRegion>, MemoryRegion) {
    (
        Arc::new(
            pd.alloc_mr(
                size.max(64),
                AccessFlags::LOCAL_WRITE | AccessFlags::MW_BIND,
            )
            .unwrap(),
        ),
        pd.alloc_mr(size.max(64), AccessFlags::LOCAL_WRITE).unwrap(),
    )
}

/// Builds a ping-pong on `client`/`server` reactors: returns the outcomes
/// (pinger, echoer).
pub fn add_ping_pong(
    pd: &ProtectionDomain,
    mut sides: Sides<'_>,
    iters: u64,
    size: usize,
    use_write_imm: bool,
) -> (Arc<Outcome>, Arc<Outcome>) {
    let (server_inbox, _) = regions(pd, size);
    let (client_inbox, client_source) = regions(pd, size);
    let (server_ep, client_ep) = connect(pd, &mut sides, &server_inbox, &client_inbox);
    let ping = Arc::new(Outcome::default());
    let echo = Arc::new(Outcome::default());
    let peer_inbox = client_ep.remote_region("inbox").expect("server inbox");
    let mut pinger = Pinger::new(
        iters,
        size,
        client_source,
        client_inbox,
        peer_inbox,
        Arc::clone(&ping),
    );
    pinger.use_write_imm = use_write_imm;
    let echoer = Echoer::new(
        server_inbox,
        server_ep.remote_region("inbox"),
        size,
        Arc::clone(&echo),
    );
    sides
        .server()
        .add(server_ep, Box::new(echoer))
        .expect("add echoer");
    sides
        .client()
        .add(client_ep, Box::new(pinger))
        .expect("add pinger");
    (ping, echo)
}

/// Builds a ping-pong on one reactor over two of its QPs connected to each
/// other directly ([`Reactor::connected_pair`]), with no session: each side's
/// inbox is registered for the other's WRITEs instead of exported through
/// memory windows, so it runs on the loopback device too. Returns the
/// outcomes (pinger, echoer).
pub fn add_ping_pong_on_qps(
    pd: &ProtectionDomain,
    reactor: &mut Reactor<BoxedHandler, ()>,
    iters: u64,
    size: usize,
    use_write_imm: bool,
) -> (Arc<Outcome>, Arc<Outcome>) {
    let inbox = || {
        let access = AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE;
        Arc::new(pd.alloc_mr(size.max(64), access).unwrap())
    };
    let (server_inbox, client_inbox) = (inbox(), inbox());
    let client_source = pd.alloc_mr(size.max(64), AccessFlags::LOCAL_WRITE).unwrap();
    let (server_qp, client_qp) = reactor
        .connected_pair(pd, AccessFlags::REMOTE_WRITE)
        .expect("two connected QPs");
    let ping = Arc::new(Outcome::default());
    let echo = Arc::new(Outcome::default());
    let mut pinger = Pinger::new(
        iters,
        size,
        client_source,
        Arc::clone(&client_inbox),
        server_inbox.remote().expect("the echoer's inbox"),
        Arc::clone(&ping),
    );
    pinger.use_write_imm = use_write_imm;
    let echoer = Echoer::new(
        Arc::clone(&server_inbox),
        Some(client_inbox.remote().expect("the pinger's inbox")),
        size,
        Arc::clone(&echo),
    );
    reactor
        .add(vec![server_qp], Box::new(echoer))
        .expect("add echoer");
    reactor
        .add(vec![client_qp], Box::new(pinger))
        .expect("add pinger");
    (ping, echo)
}

/// Builds a stream (client sends to server): returns (sender, receiver) outcomes.
pub fn add_stream(
    pd: &ProtectionDomain,
    mut sides: Sides<'_>,
    total: u64,
    max: usize,
    slow: Option<Duration>,
    stop_sender_when_done: bool,
) -> (Arc<Outcome>, Arc<Outcome>) {
    let (server_inbox, _) = regions(pd, 64);
    let (client_inbox, _) = regions(pd, 64);
    let (server_ep, client_ep) = connect(pd, &mut sides, &server_inbox, &client_inbox);
    let sent = Arc::new(Outcome::default());
    let received = Arc::new(Outcome::default());
    let mut streamer = Streamer::new(total, max, Arc::clone(&sent));
    streamer.stop_when_done = stop_sender_when_done;
    let mut sink = Sink::new(total, max, Arc::clone(&received));
    sink.slow = slow;
    sides
        .server()
        .add(server_ep, Box::new(sink))
        .expect("add sink");
    sides
        .client()
        .add(client_ep, Box::new(streamer))
        .expect("add streamer");
    (sent, received)
}

/// Runs `reactor` on its own pinned thread until it stops itself or `deadline`.
pub fn spawn(
    mut reactor: Reactor<BoxedHandler>,
    nth: usize,
) -> thread::JoinHandle<Reactor<BoxedHandler>> {
    thread::spawn(move || {
        let device = reactor_device_name();
        pin_current_thread(&device, CorePreference::NearDevice, nth);
        reactor.run().expect("reactor run");
        reactor
    })
}

fn reactor_device_name() -> String {
    std::env::var("RDMA_TEST_DEVICE").unwrap_or_else(|_| {
        devices()
            .ok()
            .and_then(|d| d.into_iter().next())
            .unwrap_or_default()
    })
}

/// Stops every reactor after `deadline` if it has not stopped on its own.
/// A test that got there only because the watchdog stopped it fails at
/// [`Watchdog::disarm`]: a hang is a failure even if the counts look right.
pub fn watchdog(stoppers: Vec<Stopper>, deadline: Duration) -> Watchdog {
    let watchdog = Watchdog {
        disarmed: Arc::new(AtomicBool::new(false)),
        fired: Arc::new(AtomicBool::new(false)),
    };
    let (disarmed, fired) = (Arc::clone(&watchdog.disarmed), Arc::clone(&watchdog.fired));
    thread::spawn(move || {
        let start = std::time::Instant::now();
        while start.elapsed() < deadline {
            if disarmed.load(Ordering::Acquire) {
                return;
            }
            thread::sleep(Duration::from_millis(20));
        }
        eprintln!("watchdog: stopping reactors after {deadline:?}");
        fired.store(true, Ordering::Release);
        for stopper in stoppers {
            stopper.stop();
        }
    });
    watchdog
}

/// See [`watchdog`].
pub struct Watchdog {
    disarmed: Arc<AtomicBool>,
    fired: Arc<AtomicBool>,
}

impl Watchdog {
    /// Stops watching; panics if the watchdog had to stop the reactors.
    #[track_caller]
    pub fn disarm(&self) {
        self.disarmed.store(true, Ordering::Release);
        assert!(
            !self.fired.load(Ordering::Acquire),
            "the reactors hung until the watchdog stopped them"
        );
    }
}
