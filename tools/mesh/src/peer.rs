//! One peer session's handler, on the reactor that serves the session:
//! 8-byte SEND ping-pongs for the latency figures, then our stream to the
//! peer (WRITE_WITH_IMM into the ring it exports, or SENDs) and its stream
//! to us, every message checked on arrival, each stream closed by its
//! message count. When both streams are over the handler posts its cell
//! on the [`Board`]. On ranks other than 0, the handler of rank 0's
//! session then sends this rank's row once every peer's cell is in,
//! whichever reactor those peers are on; on rank 0 each handler posts the
//! row its peer sends. Everything per message stays in the handler: no
//! lock, no allocation.

use std::sync::Arc;

use rdma_comm_core::reactor::*;
use rdma_comm_core::session::PeerStatus;
use rdma_comm_core::verbs::{MemoryRegion, RemoteRegion};
use rdma_perf::Clock;

use crate::args::OpArg;
use crate::board::Board;
use crate::pattern::{fill_pattern, pattern_matches};
use crate::rtt::RttRecorder;
use crate::wire::*;

/// What every peer handler of this rank does: the run's parameters.
#[derive(Debug, Clone, Copy)]
pub struct Traffic {
    /// This rank.
    pub me: usize,
    /// Number of ranks.
    pub size: usize,
    /// The streams' operation.
    pub op: OpArg,
    /// Bytes per message (at least 1).
    pub msg_size: usize,
    /// Messages the peer's ring holds (WRITE streams).
    pub blocks: u64,
    /// Fill and check every payload.
    pub verify: bool,
    /// How long each stream runs, unless `stream_bytes` is set.
    pub stream_ns: Option<u64>,
    /// How many bytes each stream carries.
    pub stream_bytes: Option<u64>,
    /// Ping-pongs for the latency figures.
    pub lat_iters: u32,
    /// Messages staged per connection and pass at most.
    pub batch: usize,
}

/// A peer's memory: our ring it WRITEs into, its ring we WRITE into, and
/// the registered source of our WRITEs (WRITE streams only).
#[derive(Debug)]
pub struct Rings {
    /// Our ring, which the peer WRITEs into.
    pub inbox: Option<Arc<MemoryRegion>>,
    /// The peer's ring.
    pub remote: Option<RemoteRegion>,
    /// What our WRITEs read from.
    pub source: Option<MemoryRegion>,
}

/// Where telling the peer that this rank gives up stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Telling {
    /// Not yet (or the rank does not give up).
    Not,
    /// The ABORT is staged: its send sequence number.
    Staged(u32),
    /// Told, or there is no telling (the peer left, the connection broke).
    Done,
}

/// The handler of one peer's session. See the module docs.
#[derive(Debug)]
pub struct PeerHandler {
    /// The run's parameters.
    traffic: Traffic,
    /// The calibrated clock (TSC).
    clock: Arc<Clock>,
    /// What crosses peers.
    board: Arc<Board>,
    /// The peer's rank.
    rank: usize,
    /// The session's one connection, once established.
    conn: Option<ConnId>,
    /// The peer's ring, ours, and our WRITEs' source.
    rings: Rings,
    /// Payload of WRITEs being filled and of arrivals being checked.
    scratch: Vec<u8>,
    /// Latency phase: pongs received so far.
    pings: u32,
    /// When the ping in flight left (clock ticks).
    ping_at: u64,
    /// Half round trips.
    half_rtts: RttRecorder,
    /// Pongs a full send queue put off.
    pongs_owed: u32,
    /// We told the peer our latency phase is over.
    latency_done_sent: bool,
    /// The peer told us its latency phase is over.
    peer_latency_done: bool,
    /// Our stream: when it started (clock ticks).
    tx_started: Option<u64>,
    /// Messages staged.
    tx_messages: u64,
    /// Bytes staged.
    tx_bytes: u64,
    /// The END's send sequence number, once staged.
    tx_end: Option<u32>,
    /// The stream's time, once the END completed.
    tx_elapsed_ns: Option<u64>,
    /// The peer's stream: messages arrived.
    rx_messages: u64,
    /// Of which corrupted, misplaced or out of order.
    rx_bad: u64,
    /// The count its END announced, once arrived.
    rx_end: Option<u64>,
    /// Our cell is on the board.
    posted: bool,
    /// The SEND of our row (rank 0's session on other ranks), once staged.
    result: Option<u32>,
    /// Telling the peer we give up.
    telling: Telling,
    /// The peer left or gave up: there is no telling it anything.
    closed: bool,
}

impl PeerHandler {
    /// The handler for peer `rank`.
    pub fn new(
        rank: usize,
        traffic: Traffic,
        clock: Arc<Clock>,
        board: Arc<Board>,
        rings: Rings,
    ) -> Self {
        PeerHandler {
            traffic,
            clock,
            board,
            rank,
            conn: None,
            rings,
            scratch: vec![0; traffic.msg_size],
            pings: 0,
            ping_at: 0,
            half_rtts: RttRecorder::new(),
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
            posted: false,
            result: None,
            telling: Telling::Not,
            closed: false,
        }
    }

    /// Records a failure concerning this peer.
    fn fail(&self, what: String) {
        self.board.fail(Some(self.rank), what);
    }

    /// Sends the next latency probe.
    fn ping(&mut self, ctx: &mut Ctx<'_>, conn: ConnId) {
        self.ping_at = self.clock.now();
        if let Err(err) = ctx.send(conn, &[0; 8], Some(tagged(PING, self.pings.into()))) {
            // One ping in flight and a fresh credit per pong: only a broken
            // connection refuses it.
            self.fail(format!("ping to rank {}: {err}", self.rank));
        }
    }

    /// Work a full send queue or a missing credit put off.
    fn catch_up(&mut self, ctx: &mut Ctx<'_>) {
        let Some(conn) = self.conn else { return };
        while self.pongs_owed > 0 && ctx.send(conn, &[0; 8], Some(tagged(PONG, 0))).is_ok() {
            self.pongs_owed -= 1;
        }
        if self.pings >= self.traffic.lat_iters
            && !self.latency_done_sent
            && ctx.send(conn, &[], Some(tagged(LATENCY_DONE, 0))).is_ok()
        {
            self.latency_done_sent = true;
        }
        self.pump(ctx);
    }

    /// Streams to the peer once both latency phases are over: as many
    /// messages as credits allow, up to one batch per pass.
    fn pump(&mut self, ctx: &mut Ctx<'_>) {
        let Some(conn) = self.conn else { return };
        if self.heed_abort(ctx)
            || !(self.latency_done_sent && self.peer_latency_done)
            || self.tx_end.is_some()
        {
            return;
        }
        let Traffic {
            me,
            msg_size,
            blocks,
            verify,
            ..
        } = self.traffic;
        let started = *self.tx_started.get_or_insert_with(|| self.clock.now());
        while ctx.staged(conn) < self.traffic.batch {
            let finished = match (self.traffic.stream_bytes, self.traffic.stream_ns) {
                (Some(limit), _) => self.tx_bytes >= limit,
                (None, Some(limit)) => self.clock.nanos(started, self.clock.now()) >= limit,
                (None, None) => true,
            };
            if finished {
                match ctx.send(conn, &self.tx_messages.to_le_bytes(), Some(tagged(END, 0))) {
                    Ok(seq) => {
                        ctx.signal_staged(conn);
                        self.tx_end = Some(seq);
                    }
                    Err(SendError::WouldBlock) => {}
                    Err(err) => {
                        self.fail(format!("ending the stream to rank {}: {err}", self.rank));
                    }
                }
                return;
            }
            let seq = self.tx_messages;
            let len = match self.traffic.stream_bytes {
                Some(limit) => msg_size.min((limit - self.tx_bytes) as usize),
                None => msg_size,
            };
            let to = self.rank;
            let staged = match (self.traffic.op, &mut self.rings.source, &self.rings.remote) {
                (OpArg::Send, _, _) => ctx.send_with(conn, len, Some(tagged(DATA, seq)), |buf| {
                    if verify {
                        fill_pattern(buf, me, to, seq);
                    }
                }),
                (OpArg::Write, Some(source), Some(remote)) => {
                    let offset = (seq % blocks) as usize * msg_size;
                    if verify {
                        let scratch = &mut self.scratch[..len];
                        fill_pattern(scratch, me, to, seq);
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
                            ctx.write(conn, &local, target, Some(seq as u32))
                        }
                        (Err(err), _) | (_, Err(err)) => Err(SendError::Invalid(err)),
                    }
                }
                (OpArg::Write, _, _) => {
                    self.fail(format!("rank {to} exported no inbox"));
                    return;
                }
            };
            match staged {
                Ok(_) => {
                    self.tx_messages += 1;
                    self.tx_bytes += len as u64;
                }
                Err(SendError::WouldBlock) => return,
                Err(err) => {
                    self.fail(format!("streaming to rank {to}: {err}"));
                    return;
                }
            }
        }
    }

    /// Counts a stream message from the peer, bad unless both hold.
    fn received(&mut self, seq_ok: bool, content_ok: bool) {
        if !(seq_ok && content_ok) {
            self.rx_bad += 1;
        }
        self.rx_messages += 1;
    }

    /// Posts our cell once both streams are over.
    fn streams_over(&mut self, ctx: &mut Ctx<'_>) {
        if self.posted || self.tx_elapsed_ns.is_none() || self.rx_end.is_none() {
            return;
        }
        self.posted = true;
        let cell = Cell {
            latency_ns: self.half_rtts.quantile_ns(0.5),
            bytes: self.tx_bytes,
            elapsed_ns: self.tx_elapsed_ns.unwrap_or(0),
            bad: self.rx_bad,
        };
        self.board.post_cell(self.rank, cell);
        self.report(ctx);
    }

    /// Rank 0's session on other ranks: sends this rank's row to rank 0
    /// once every peer's cell is on the board.
    fn report(&mut self, ctx: &mut Ctx<'_>) {
        let Some(conn) = self.conn else { return };
        if self.traffic.me == 0
            || self.rank != 0
            || self.result.is_some()
            || !self.board.row_ready()
        {
            return;
        }
        let board = &self.board;
        let len = self.traffic.size * CELL_BYTES;
        match ctx.send_with(conn, len, Some(tagged(RESULT, 0)), |buf| {
            board.fill_row(buf)
        }) {
            Ok(seq) => {
                ctx.signal_staged(conn);
                self.result = Some(seq);
            }
            Err(SendError::WouldBlock) => {}
            Err(err) => self.fail(format!("reporting to rank 0: {err}")),
        }
    }

    /// Once this rank gives up: streams no more, and tells the peer in an
    /// ABORT naming the rank it gives up over (a SEND, so it arrives after
    /// everything sent before it). Returns whether the rank gives up.
    fn heed_abort(&mut self, ctx: &mut Ctx<'_>) -> bool {
        let Some(culprit) = self.board.abort_requested() else {
            return false;
        };
        if self.telling == Telling::Not {
            let imm = tagged(ABORT, culprit.map_or(NOBODY, |rank| rank as u64));
            match self.conn.filter(|_| !self.closed) {
                Some(conn) => match ctx.send(conn, &[], Some(imm)) {
                    Ok(seq) => {
                        ctx.signal_staged(conn);
                        self.telling = Telling::Staged(seq);
                    }
                    Err(SendError::WouldBlock) => {}
                    Err(_) => self.told(),
                },
                None => self.told(),
            }
        }
        true
    }

    /// The peer was told we give up, or cannot be: the board counts it once.
    fn told(&mut self) {
        if self.telling != Telling::Done {
            self.telling = Telling::Done;
            self.board.told();
        }
    }
}

/// A peer's hang-up, in words after "rank N".
fn describe_hang_up(code: u16) -> String {
    match code {
        0 => "hung up early".to_string(),
        code => format!("hung up early (code {code})"),
    }
}

impl Handler for PeerHandler {
    fn on_peer_gone(&mut self, _ctx: &mut Ctx<'_>, _session: SessionId, status: &PeerStatus) {
        let (why, lost) = match status {
            PeerStatus::Alive => return,
            PeerStatus::Disconnected { code } => (describe_hang_up(*code), false),
            PeerStatus::Lost(err) => (format!("was lost: {err}"), true),
        };
        self.closed = true;
        self.board.peer_gone(self.rank, why, Some(self.rank), lost);
    }

    fn on_established(&mut self, ctx: &mut Ctx<'_>, conn: ConnId) {
        self.conn = Some(conn);
        if self.heed_abort(ctx) {
            return;
        }
        if self.traffic.lat_iters == 0 {
            self.catch_up(ctx);
        } else {
            self.ping(ctx, conn);
        }
    }

    fn on_message(&mut self, ctx: &mut Ctx<'_>, conn: ConnId, data: &[u8], imm: Option<u32>) {
        let imm = imm.unwrap_or(0);
        let (kind, low) = untagged(imm);
        match kind {
            PING => {
                if ctx.send(conn, data, Some(tagged(PONG, low))).is_err() {
                    self.pongs_owed += 1;
                }
            }
            PONG => {
                let rtt = self.clock.nanos(self.ping_at, self.clock.now());
                self.half_rtts.record(rtt / 2);
                self.pings += 1;
                if self.pings < self.traffic.lat_iters && !self.heed_abort(ctx) {
                    self.ping(ctx, conn);
                } else {
                    self.catch_up(ctx);
                }
            }
            LATENCY_DONE => {
                self.peer_latency_done = true;
                self.catch_up(ctx);
            }
            DATA => {
                let expected = self.rx_messages;
                let content_ok = !self.traffic.verify
                    || pattern_matches(data, self.rank, self.traffic.me, expected);
                self.received(low == expected & 0x00ff_ffff, content_ok);
            }
            END => {
                let count = data.try_into().map(u64::from_le_bytes).unwrap_or(u64::MAX);
                if count != self.rx_messages {
                    let (rank, got) = (self.rank, self.rx_messages);
                    self.fail(format!("rank {rank} sent {count} messages, {got} arrived"));
                }
                self.rx_end = Some(count);
                self.streams_over(ctx);
            }
            RESULT if self.traffic.me == 0 => {
                let row = data.chunks_exact(CELL_BYTES).map(Cell::decode).collect();
                self.board.post_row(self.rank, row);
            }
            ABORT => {
                // It leaves next: nothing to tell it, and whether that costs
                // us anything is the board's call.
                self.closed = true;
                let (why, culprit) = match low {
                    NOBODY => ("gave up".to_string(), self.rank),
                    rank => (format!("gave up over rank {rank}"), rank as usize),
                };
                self.board.peer_gone(self.rank, why, Some(culprit), false);
            }
            _ => {
                let rank = self.rank;
                self.fail(format!("unexpected message {imm:#x} from rank {rank}"));
            }
        }
    }

    fn on_write_imm(&mut self, _ctx: &mut Ctx<'_>, _conn: ConnId, imm: u32, len: u32) {
        let expected = self.rx_messages;
        let content_ok = match (&self.rings.inbox, self.traffic.verify) {
            (_, false) => true,
            (Some(inbox), true) => {
                let offset = (expected % self.traffic.blocks) as usize * self.traffic.msg_size;
                // A peer's length beyond our message size (a rank started
                // with another --msg-size) is a bad message, not a panic.
                // The peer reuses this block only after our receive for it
                // is reposted, which happens after this callback returns.
                self.scratch.get_mut(..len as usize).is_some_and(|scratch| {
                    inbox.read(offset, scratch).is_ok()
                        && pattern_matches(scratch, self.rank, self.traffic.me, expected)
                })
            }
            (None, true) => false,
        };
        self.received(imm == expected as u32, content_ok);
    }

    fn on_send_complete(&mut self, ctx: &mut Ctx<'_>, _conn: ConnId, seq: u32) {
        if self.tx_end == Some(seq) && self.tx_elapsed_ns.is_none() {
            let now = self.clock.now();
            self.tx_elapsed_ns = Some(self.clock.nanos(self.tx_started.unwrap_or(now), now));
            self.streams_over(ctx);
        }
        if self.result == Some(seq) {
            self.board.row_delivered();
        }
        if self.telling == Telling::Staged(seq) {
            self.told();
        }
        self.pump(ctx);
    }

    fn on_write_complete(&mut self, ctx: &mut Ctx<'_>, _conn: ConnId, _seq: u32) {
        self.pump(ctx);
    }

    fn on_error(&mut self, _ctx: &mut Ctx<'_>, _conn: ConnId, error: &rdma_comm_core::Error) {
        let rank = self.rank;
        self.fail(format!("connection to rank {rank}: {error}"));
    }

    fn on_idle(&mut self, ctx: &mut Ctx<'_>) -> Idle {
        if self.heed_abort(ctx) {
            return Idle::Again;
        }
        self.catch_up(ctx);
        self.report(ctx);
        Idle::Again
    }
}
