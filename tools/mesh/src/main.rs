//! Full-mesh traffic between cluster ranks (the successor of
//! mesh_comm_service). Started by the site's launcher, never by ssh, through
//! the `tools/mesh/run` script, which runs the binary `target/release/mesh`:
//!
//! ```text
//! mpirun -np 4 tools/mesh/run --op write --duration 5
//! srun -N 4 --ntasks-per-node=1 tools/mesh/run --op send --bytes 1G
//! tools/mesh/run --rank 1 --size 2 --hosts node1,node2     # by hand
//! ```
//!
//! Every rank connects to every other one (rank r listens on
//! `--base-port + r`, accepts the higher ranks and connects to the lower
//! ones), all on one reactor. Each pair first measures latency with 8-byte
//! SEND ping-pongs in both directions, then both directions stream WRITE_WITH_IMM
//! (into a ring the peer exports) or SEND traffic for `--duration` or
//! `--bytes`, every message filled with a pattern unique to sender, receiver
//! and sequence number and checked on arrival. Each stream ends with its
//! message count, which the receiver checks. Rank 0 gathers every rank's row
//! and prints the latency and bandwidth matrices.
//!
//! A crate of its own (`rdma-mesh`, binary `mesh`), so that a service
//! embedding `rdma-comm-core` compiles neither it nor [`cluster`].
#![deny(missing_docs, missing_debug_implementations)]
#![deny(unsafe_op_in_unsafe_fn)]

use std::cell::RefCell;
use std::process::ExitCode;
use std::rc::Rc;
use std::sync::Arc;
use std::time::{Duration, Instant};

// The device and reactor flags every example shares, from the same file.
#[path = "../../../examples/common/mod.rs"]
mod common;

mod args;
mod cluster;
mod pattern;
mod report;
mod wire;

use args::{Args, OpArg};
use clap::Parser;
use cluster::{World, parse_hostfile};
use pattern::{fill_pattern, pattern_matches};
use rdma_comm_core::reactor::*;
use rdma_comm_core::session::*;
use rdma_comm_core::verbs::*;
use rdma_perf::Clock;
use report::Report;
use wire::*;

/// Everything about one peer.
struct Peer {
    rank: usize,
    conn: ConnId,
    session: SessionId,
    /// Our ring the peer WRITEs into, and the peer's ring we WRITE into.
    inbox: Option<Arc<MemoryRegion>>,
    remote: Option<RemoteRegion>,
    source: Option<MemoryRegion>,
    // Latency phase.
    pings: u32,
    ping_at: u64,
    samples_ns: Vec<u64>,
    pongs_owed: u32,
    latency_done_sent: bool,
    peer_latency_done: bool,
    // Our stream to the peer.
    tx_started: Option<u64>,
    tx_messages: u64,
    tx_bytes: u64,
    tx_end: Option<u32>,
    tx_elapsed_ns: Option<u64>,
    // The peer's stream to us.
    rx_messages: u64,
    rx_bad: u64,
    rx_end: Option<u64>,
    /// The peer's row (rank 0 only).
    row: Option<Vec<Cell>>,
    closed: bool,
}

impl Peer {
    fn streams_done(&self) -> bool {
        self.tx_elapsed_ns.is_some() && self.rx_end.is_some()
    }

    fn cell(&self) -> Cell {
        let mut samples = self.samples_ns.clone();
        samples.sort_unstable();
        Cell {
            latency_ns: samples.get(samples.len() / 2).copied().unwrap_or(0),
            bytes: self.tx_bytes,
            elapsed_ns: self.tx_elapsed_ns.unwrap_or(0),
            bad: self.rx_bad,
        }
    }
}

/// The mesh as seen from one rank; one handler for all its sessions.
struct Mesh {
    me: usize,
    size: usize,
    op: OpArg,
    msg_size: usize,
    blocks: u64,
    verify: bool,
    stream_ns: Option<u64>,
    stream_bytes: Option<u64>,
    lat_iters: u32,
    batch: usize,
    clock: Clock,
    peers: Vec<Peer>,
    /// Peer index by connection index.
    by_conn: Vec<usize>,
    scratch: Vec<u8>,
    result: Option<u32>,
    result_sent: bool,
    /// The first failure: the rank it concerns and what happened.
    failure: Option<(usize, String)>,
    /// Peers the reactor's watch found gone: index, when, and how.
    gone: Vec<(usize, Instant, String)>,
}

impl Mesh {
    fn peer_of(&self, conn: ConnId) -> usize {
        self.by_conn[conn.slot()]
    }

    fn fail(&mut self, rank: usize, what: String) {
        self.failure.get_or_insert((rank, what));
    }

    fn ping(&mut self, ctx: &mut Ctx<'_>, index: usize) {
        let peer = &mut self.peers[index];
        peer.ping_at = self.clock.now();
        if let Err(err) = ctx.send(peer.conn, &[0; 8], Some(tagged(PING, peer.pings.into()))) {
            // One ping in flight and a fresh credit per pong: only a broken
            // connection refuses it.
            let rank = self.peers[index].rank;
            self.fail(rank, format!("ping to rank {rank}: {err}"));
        }
    }

    /// Work a full send queue or a missing credit put off.
    fn catch_up(&mut self, ctx: &mut Ctx<'_>, index: usize) {
        let peer = &mut self.peers[index];
        while peer.pongs_owed > 0 && ctx.send(peer.conn, &[0; 8], Some(tagged(PONG, 0))).is_ok() {
            peer.pongs_owed -= 1;
        }
        if peer.pings >= self.lat_iters
            && !peer.latency_done_sent
            && ctx
                .send(peer.conn, &[], Some(tagged(LATENCY_DONE, 0)))
                .is_ok()
        {
            peer.latency_done_sent = true;
        }
        self.pump(ctx, index);
    }

    /// Streams to a peer once both latency phases are over: as many
    /// messages as credits allow, up to one batch per pass.
    fn pump(&mut self, ctx: &mut Ctx<'_>, index: usize) {
        let (me, msg_size, blocks, verify) = (self.me, self.msg_size, self.blocks, self.verify);
        let now = self.clock.now();
        let peer = &mut self.peers[index];
        if !(peer.latency_done_sent && peer.peer_latency_done) || peer.tx_end.is_some() {
            return;
        }
        let started = *peer.tx_started.get_or_insert(now);
        while ctx.staged(peer.conn) < self.batch {
            let finished = match (self.stream_bytes, self.stream_ns) {
                (Some(limit), _) => peer.tx_bytes >= limit,
                (None, Some(limit)) => self.clock.nanos(started, self.clock.now()) >= limit,
                (None, None) => true,
            };
            if finished {
                match ctx.send(
                    peer.conn,
                    &peer.tx_messages.to_le_bytes(),
                    Some(tagged(END, 0)),
                ) {
                    Ok(seq) => {
                        ctx.signal_staged(peer.conn);
                        peer.tx_end = Some(seq);
                    }
                    Err(SendError::WouldBlock) => {}
                    Err(err) => {
                        let rank = peer.rank;
                        self.fail(rank, format!("ending the stream to rank {rank}: {err}"));
                    }
                }
                return;
            }
            let seq = peer.tx_messages;
            let len = match self.stream_bytes {
                Some(limit) => msg_size.min((limit - peer.tx_bytes) as usize),
                None => msg_size,
            };
            let staged = match (self.op, &mut peer.source, &peer.remote) {
                (OpArg::Send, _, _) => {
                    ctx.send_with(peer.conn, len, Some(tagged(DATA, seq)), |buf| {
                        if verify {
                            fill_pattern(buf, me, peer.rank, seq);
                        }
                    })
                }
                (OpArg::Write, Some(source), Some(remote)) => {
                    let offset = (seq % blocks) as usize * msg_size;
                    if verify {
                        let scratch = &mut self.scratch[..len];
                        fill_pattern(scratch, me, peer.rank, seq);
                        // The block's previous message was consumed by the
                        // peer before this credit came back, so no request
                        // still reads it.
                        let _ = source.write(offset, scratch);
                    }
                    match (
                        source.slice(offset, len),
                        remote.slice(offset as u64, len as u64),
                    ) {
                        (Ok(local), Ok(target)) => {
                            ctx.write(peer.conn, &local, target, Some(seq as u32))
                        }
                        (Err(err), _) | (_, Err(err)) => Err(SendError::Invalid(err)),
                    }
                }
                (OpArg::Write, _, _) => {
                    let rank = peer.rank;
                    self.fail(rank, format!("rank {rank} exported no inbox"));
                    return;
                }
            };
            match staged {
                Ok(_) => {
                    peer.tx_messages += 1;
                    peer.tx_bytes += len as u64;
                }
                Err(SendError::WouldBlock) => return,
                Err(err) => {
                    let rank = peer.rank;
                    self.fail(rank, format!("streaming to rank {rank}: {err}"));
                    return;
                }
            }
        }
    }

    fn received(&mut self, index: usize, seq_ok: bool, content_ok: bool) {
        let peer = &mut self.peers[index];
        if !(seq_ok && content_ok) {
            peer.rx_bad += 1;
        }
        peer.rx_messages += 1;
    }

    /// Ranks other than 0 report their row once every stream is over.
    fn report(&mut self, ctx: &mut Ctx<'_>) {
        if self.me == 0 || self.result.is_some() || !self.peers.iter().all(Peer::streams_done) {
            return;
        }
        let Some(root) = self.peers.iter().find(|p| p.rank == 0) else {
            return;
        };
        let mut row = vec![Cell::default(); self.size];
        for peer in &self.peers {
            row[peer.rank] = peer.cell();
        }
        let conn = root.conn;
        let staged = ctx.send_with(
            conn,
            self.size * CELL_BYTES,
            Some(tagged(RESULT, 0)),
            |buf| {
                for (cell, out) in row.iter().zip(buf.chunks_exact_mut(CELL_BYTES)) {
                    cell.encode(out);
                }
            },
        );
        match staged {
            Ok(seq) => {
                ctx.signal_staged(conn);
                self.result = Some(seq);
            }
            Err(SendError::WouldBlock) => {}
            Err(err) => self.fail(0, format!("reporting to rank 0: {err}")),
        }
    }

    fn finished(&self) -> bool {
        if self.me == 0 {
            self.peers
                .iter()
                .all(|p| p.streams_done() && p.row.is_some())
        } else {
            self.result_sent
        }
    }

    /// Whether a peer may hang up now without anything being lost.
    fn done_with(&self, index: usize) -> bool {
        let peer = &self.peers[index];
        peer.streams_done() && (self.me != 0 || peer.row.is_some())
    }
}

impl Handler for Mesh {
    fn on_peer_gone(&mut self, _ctx: &mut Ctx<'_>, session: SessionId, status: &PeerStatus) {
        let why = match status {
            PeerStatus::Alive => return,
            PeerStatus::Disconnected { code } => describe_hang_up(*code),
            PeerStatus::Lost(err) => format!("was lost: {err}"),
        };
        let Some(index) = self.peers.iter().position(|p| p.session == session) else {
            return;
        };
        self.peers[index].closed = true;
        self.gone.push((index, Instant::now(), why));
    }

    fn on_established(&mut self, ctx: &mut Ctx<'_>, conn: ConnId) {
        let index = self.peer_of(conn);
        if self.lat_iters == 0 {
            self.catch_up(ctx, index);
        } else {
            self.ping(ctx, index);
        }
    }

    fn on_message(&mut self, ctx: &mut Ctx<'_>, conn: ConnId, data: &[u8], imm: Option<u32>) {
        let index = self.peer_of(conn);
        let imm = imm.unwrap_or(0);
        let (kind, low) = untagged(imm);
        match kind {
            PING => {
                if ctx.send(conn, data, Some(tagged(PONG, low))).is_err() {
                    self.peers[index].pongs_owed += 1;
                }
            }
            PONG => {
                let now = self.clock.now();
                let peer = &mut self.peers[index];
                let rtt = self.clock.nanos(peer.ping_at, now);
                peer.samples_ns.push(rtt / 2);
                peer.pings += 1;
                if peer.pings < self.lat_iters {
                    self.ping(ctx, index);
                } else {
                    self.catch_up(ctx, index);
                }
            }
            LATENCY_DONE => {
                self.peers[index].peer_latency_done = true;
                self.catch_up(ctx, index);
            }
            DATA => {
                let (from, expected) = (self.peers[index].rank, self.peers[index].rx_messages);
                let content_ok = !self.verify || pattern_matches(data, from, self.me, expected);
                self.received(index, low == expected & 0x00ff_ffff, content_ok);
            }
            END => {
                let count = data.try_into().map(u64::from_le_bytes).unwrap_or(u64::MAX);
                let peer = &mut self.peers[index];
                if count != peer.rx_messages {
                    let rank = peer.rank;
                    let got = peer.rx_messages;
                    self.fail(
                        rank,
                        format!("rank {rank} sent {count} messages, {got} arrived"),
                    );
                }
                self.peers[index].rx_end = Some(count);
                self.report(ctx);
            }
            RESULT if self.me == 0 => {
                let row = data.chunks_exact(CELL_BYTES).map(Cell::decode).collect();
                self.peers[index].row = Some(row);
            }
            _ => {
                let rank = self.peers[index].rank;
                self.fail(
                    rank,
                    format!("unexpected message {imm:#x} from rank {rank}"),
                );
            }
        }
    }

    fn on_write_imm(&mut self, _ctx: &mut Ctx<'_>, conn: ConnId, imm: u32, len: u32) {
        let index = self.peer_of(conn);
        let (from, expected) = (self.peers[index].rank, self.peers[index].rx_messages);
        let content_ok = match (&self.peers[index].inbox, self.verify) {
            (_, false) => true,
            (Some(inbox), true) => {
                let offset = (expected % self.blocks) as usize * self.msg_size;
                let scratch = &mut self.scratch[..len as usize];
                // The peer reuses this block only after our receive for it is
                // reposted, which happens after this callback returns.
                inbox.read(offset, scratch).is_ok()
                    && pattern_matches(scratch, from, self.me, expected)
            }
            (None, true) => false,
        };
        self.received(index, imm == expected as u32, content_ok);
    }

    fn on_send_complete(&mut self, ctx: &mut Ctx<'_>, conn: ConnId, seq: u32) {
        let index = self.peer_of(conn);
        let now = self.clock.now();
        let peer = &mut self.peers[index];
        if peer.tx_end == Some(seq) && peer.tx_elapsed_ns.is_none() {
            peer.tx_elapsed_ns = Some(self.clock.nanos(peer.tx_started.unwrap_or(now), now));
            self.report(ctx);
        }
        if self.result == Some(seq) && self.peers[index].rank == 0 {
            self.result_sent = true;
        }
        self.pump(ctx, index);
    }

    fn on_write_complete(&mut self, ctx: &mut Ctx<'_>, conn: ConnId, _seq: u32) {
        let index = self.peer_of(conn);
        self.pump(ctx, index);
    }

    fn on_error(&mut self, _ctx: &mut Ctx<'_>, conn: ConnId, error: &rdma_comm_core::Error) {
        let rank = self.peers[self.peer_of(conn)].rank;
        self.fail(rank, format!("connection to rank {rank}: {error}"));
    }

    fn on_idle(&mut self, ctx: &mut Ctx<'_>) {
        for index in 0..self.peers.len() {
            self.catch_up(ctx, index);
        }
        self.report(ctx);
    }
}

fn main() -> ExitCode {
    let args = Args::parse();
    match run(&args) {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::FAILURE,
        Err(failure) => {
            eprintln!("mesh: {failure}");
            ExitCode::FAILURE
        }
    }
}

fn world(args: &Args) -> Result<World, String> {
    let hosts = match (&args.hosts, &args.hostfile) {
        (Some(hosts), _) => Some(hosts.clone()),
        (None, Some(path)) => {
            let text = std::fs::read_to_string(path)
                .map_err(|err| format!("reading {}: {err}", path.display()))?;
            Some(parse_hostfile(&text).map_err(|err| format!("{}: {err}", path.display()))?)
        }
        (None, None) => None,
    };
    World::discover(args.rank, args.size, hosts, |key| std::env::var(key).ok())
        .map_err(|err| err.to_string())
}

fn address(host: &str, port: u16) -> String {
    if host.contains(':') && !host.starts_with('[') {
        format!("[{host}]:{port}")
    } else {
        format!("{host}:{port}")
    }
}

fn reactor_config(args: &Args, peers: usize) -> ReactorConfig {
    let payload = match args.op {
        OpArg::Send => args.msg_size,
        OpArg::Write => 0,
    };
    ReactorConfig {
        event_mode: args.reactor.event_mode_or(common::EventArg::Busy).into(),
        slot_size: (payload.max((peers + 1) * CELL_BYTES).max(64) + CREDIT_HEADER_LEN)
            .next_multiple_of(64),
        signal_interval: args.reactor.signal_interval,
        ..ReactorConfig::for_traffic(0, args.depth, peers.max(1) as u32)
    }
    .watching_peers(PEER_CHECK_INTERVAL)
}

/// Connects to every other rank; returns the endpoints, by peer rank.
fn connect_all(
    args: &Args,
    world: &World,
    pd: &ProtectionDomain,
    reactor: &mut Reactor<Rc<RefCell<Mesh>>>,
) -> Result<Vec<(usize, Endpoint)>, String> {
    let access = match args.op {
        OpArg::Write => AccessFlags::REMOTE_WRITE,
        OpArg::Send => AccessFlags::empty(),
    };
    let inbox_len = args.msg_size.max(1) * args.depth.clamp(4, 4096) as usize;
    let exports = move |pd: &ProtectionDomain| -> rdma_comm_core::Result<Vec<Export>> {
        if access.is_empty() {
            return Ok(Vec::new());
        }
        let inbox = pd.alloc_mr(inbox_len, AccessFlags::LOCAL_WRITE | AccessFlags::MW_BIND)?;
        Ok(vec![Export::shared(
            1,
            "inbox",
            Arc::new(inbox),
            AccessFlags::REMOTE_WRITE,
        )])
    };
    let higher = world.size - 1 - world.rank;
    let mut config = reactor.server_config(access);
    args.dev.apply(&mut config.qp);
    config.max_peers = Some(higher);
    let key = args.auth.key().map_err(|err| err.to_string())?;
    config.auth_key = key.clone();
    config.exports = Some(Arc::new(move |_, pd: &ProtectionDomain| exports(pd)));
    let listen = format!("0.0.0.0:{}", args.base_port as usize + world.rank);
    let server = ServerSession::bind(listen.as_str(), pd, config.clone())
        .map_err(|err| format!("listening on {listen}: {err}"))?;
    let mut endpoints = Vec::new();
    for rank in 0..world.rank {
        let mut spec = reactor.qp_spec_with_access(format!("rank-{}", world.rank), access);
        args.dev.apply(&mut spec.qp);
        let mut client = ClientConfig::new(vec![spec]);
        if !access.is_empty() {
            let inbox = pd
                .alloc_mr(inbox_len, AccessFlags::LOCAL_WRITE | AccessFlags::MW_BIND)
                .map_err(|err| err.to_string())?;
            client = client.with_exports(vec![Export::shared(
                1,
                "inbox",
                Arc::new(inbox),
                AccessFlags::REMOTE_WRITE,
            )]);
        }
        client.connect_deadline = Duration::from_secs(args.connect_timeout);
        client.auth_key = key.clone();
        let peer = address(world.host(rank), (args.base_port as usize + rank) as u16);
        let endpoint = ClientSession::connect(peer.as_str(), pd, &client)
            .map_err(|err| format!("connecting to rank {rank} at {peer}: {err}"))?;
        endpoints.push((rank, endpoint));
    }
    let deadline = Instant::now() + Duration::from_secs(args.connect_timeout);
    while endpoints.len() < world.size - 1 {
        let left = deadline.saturating_duration_since(Instant::now());
        let endpoint = server.accept_timeout(left).ok_or_else(|| {
            let failures: Vec<String> = server
                .take_failures()
                .iter()
                .map(|f| format!("{}: {}", f.peer, f.error))
                .collect();
            format!(
                "only {} of {higher} higher ranks connected within {}s{}",
                endpoints.len() - world.rank,
                args.connect_timeout,
                if failures.is_empty() {
                    String::new()
                } else {
                    format!(" (rejected: {})", failures.join("; "))
                }
            )
        })?;
        let rank = endpoint.qps()[0]
            .name()
            .strip_prefix("rank-")
            .and_then(|r| r.parse::<usize>().ok())
            .filter(|&r| r > world.rank && r < world.size && endpoints.iter().all(|(e, _)| *e != r))
            .ok_or_else(|| format!("{} is not a mesh rank we expect", endpoint.peer()))?;
        endpoints.push((rank, endpoint));
    }
    Ok(endpoints)
}

fn run(args: &Args) -> Result<bool, String> {
    let world = world(args)?;
    let ctx = Context::open_default(args.dev.device.as_deref()).map_err(|err| err.to_string())?;
    if !args.no_pin {
        let preference = match &args.cores {
            Some(list) => {
                let cores = rdma_comm_core::runtime::parse_core_list(list)
                    .map_err(|err| err.to_string())?;
                let core = cores.get(world.local_rank).copied().ok_or_else(|| {
                    format!(
                        "--cores lists {} cores, but this node runs node-local rank {}",
                        cores.len(),
                        world.local_rank
                    )
                })?;
                CorePreference::Core(core)
            }
            None => CorePreference::NearDevice,
        };
        let placement = pin_current_thread(ctx.name(), preference, world.local_rank);
        if let (Some(reason), true) = (&placement.fallback, world.rank == 0) {
            match placement.core {
                Some(core) => eprintln!(
                    "mesh: rank 0 runs on core {core} ({reason}, so any core will do; each rank takes the core of its node-local rank)"
                ),
                None => eprintln!("mesh: rank 0 is not pinned ({reason}, and pinning failed)"),
            }
        }
    }
    let pd = ctx.alloc_pd().map_err(|err| err.to_string())?;
    let mut reactor =
        Reactor::new(&pd, reactor_config(args, world.size - 1)).map_err(|err| err.to_string())?;
    let endpoints = connect_all(args, &world, &pd, &mut reactor)?;
    let msg_size = args.msg_size.max(1);
    let mesh = Rc::new(RefCell::new(Mesh {
        me: world.rank,
        size: world.size,
        op: args.op,
        msg_size,
        blocks: u64::from(args.depth.clamp(4, 4096)),
        verify: !args.no_verify,
        stream_ns: Some((args.duration.max(0.0) * 1e9) as u64),
        stream_bytes: args.bytes,
        lat_iters: args.lat_iters,
        batch: args.reactor.batch_or(16),
        clock: Clock::new(),
        peers: Vec::new(),
        by_conn: Vec::new(),
        scratch: vec![0; msg_size],
        result: None,
        result_sent: false,
        failure: None,
        gone: Vec::new(),
    }));
    for (rank, endpoint) in endpoints {
        let inbox = endpoint.exports().first().and_then(|e| e.memory.clone());
        let remote = endpoint.remote_region("inbox");
        let source = match args.op {
            OpArg::Write => Some(
                pd.alloc_mr(
                    msg_size * args.depth.clamp(4, 4096) as usize,
                    AccessFlags::empty(),
                )
                .map_err(|err| err.to_string())?,
            ),
            OpArg::Send => None,
        };
        let session = reactor
            .add(endpoint, Rc::clone(&mesh))
            .map_err(|err| err.to_string())?;
        let conn = reactor
            .conns(session)
            .next()
            .ok_or("an endpoint without a channel")?;
        let mut state = mesh.borrow_mut();
        let index = state.peers.len();
        if state.by_conn.len() <= conn.slot() {
            state.by_conn.resize(conn.slot() + 1, usize::MAX);
        }
        state.by_conn[conn.slot()] = index;
        state.peers.push(Peer {
            rank,
            conn,
            session,
            inbox,
            remote,
            source,
            pings: 0,
            ping_at: 0,
            samples_ns: Vec::with_capacity(args.lat_iters as usize),
            pongs_owed: 0,
            latency_done_sent: false,
            peer_latency_done: false,
            tx_started: None,
            tx_messages: 0,
            tx_bytes: 0,
            tx_end: None,
            tx_elapsed_ns: None,
            rx_messages: 0,
            rx_bad: 0,
            rx_end: None,
            row: None,
            closed: false,
        });
    }
    drive(&mut reactor, &mesh)?;
    let state = mesh.borrow();
    let bad: u64 = state.peers.iter().map(|p| p.rx_bad).sum();
    if bad > 0 {
        eprintln!(
            "mesh: rank {}: {bad} messages arrived corrupted, misplaced or out of order",
            state.me
        );
    }
    if state.me == 0 {
        let mut cells = vec![vec![Cell::default(); world.size]; world.size];
        for peer in &state.peers {
            cells[0][peer.rank] = peer.cell();
            if let Some(row) = &peer.row {
                for (to, cell) in row.iter().enumerate().take(world.size) {
                    cells[peer.rank][to] = *cell;
                }
            }
        }
        let report = Report::new(args, &world, cells);
        report.print();
        if let Some(path) = &args.json {
            std::fs::write(path, report.json()).map_err(|err| format!("writing {path}: {err}"))?;
        }
        return Ok(report.bad == 0);
    }
    Ok(bad == 0)
}

/// After a peer hangs up, completions it caused may still be queued.
const LAST_WORDS: Duration = Duration::from_millis(500);
/// How often the reactor looks at every peer's control connection.
const PEER_CHECK_INTERVAL: Duration = Duration::from_millis(100);

/// The disconnect code of a rank that gives up: the high bit marks the
/// abort, the low bits name the rank it gave up over. Its other peers can
/// then name the cause instead of only the rank that left first.
const ABORT: u16 = 0x8000;

fn abort_code(culprit: usize) -> u16 {
    ABORT | u16::try_from(culprit).map_or(!ABORT, |rank| rank.min(!ABORT))
}

fn describe_hang_up(code: u16) -> String {
    match code {
        0 => "hung up early".to_string(),
        code if code & ABORT != 0 => format!("gave up over rank {}", code & !ABORT),
        code => format!("hung up early (code {code})"),
    }
}

/// Turns the reactor until this rank is done, watching the control
/// connections: a peer may leave once nothing more is owed either way.
fn drive(reactor: &mut Reactor<Rc<RefCell<Mesh>>>, mesh: &Rc<RefCell<Mesh>>) -> Result<(), String> {
    // The reactor watches every peer's control connection (Mesh::on_peer_gone).
    loop {
        reactor.turn().map_err(|err| err.to_string())?;
        let abort = {
            let state = mesh.borrow();
            if state.finished() && state.failure.is_none() {
                return Ok(());
            }
            let lost = state
                .gone
                .iter()
                .find(|(index, since, _)| !state.done_with(*index) && since.elapsed() > LAST_WORDS)
                .map(|(index, _, why)| {
                    let rank = state.peers[*index].rank;
                    (rank, format!("rank {rank} {why}"))
                });
            state.failure.clone().or(lost)
        };
        if let Some((culprit, what)) = abort {
            let me = mesh.borrow().me;
            tell_the_others(reactor, mesh, abort_code(culprit));
            return Err(format!("rank {me}: {what}"));
        }
    }
}

/// Peer index and session of every peer whose control connection is open.
fn open_sessions(mesh: &Rc<RefCell<Mesh>>) -> Vec<(usize, SessionId)> {
    let state = mesh.borrow();
    let open = state
        .peers
        .iter()
        .enumerate()
        .filter(|(_, peer)| !peer.closed);
    open.map(|(index, peer)| (index, peer.session)).collect()
}

/// Sends every peer still there the disconnect code before this rank quits.
fn tell_the_others(reactor: &mut Reactor<Rc<RefCell<Mesh>>>, mesh: &Rc<RefCell<Mesh>>, code: u16) {
    for (_, session) in open_sessions(mesh) {
        if let Some(link) = reactor.link_mut(session) {
            link.send_disconnect(code);
        }
    }
}
