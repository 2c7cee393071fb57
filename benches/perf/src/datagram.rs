//! UD roles, run on a datagram endpoint of the reactor
//! (`Reactor::add_datagram`): the client that times ping-pongs or streams
//! datagrams, the server that echoes or counts them, and the exchange of
//! the two endpoints over the session's RC connection (as perftest
//! exchanges its UD QP's address over TCP).
//!
//! A datagram may be lost: a ping whose echo does not come within
//! [`RESEND_AFTER`] goes again (counted), and a stream ends with an end
//! mark, repeated until the server's report of what it received arrives.

use std::time::Duration;

use rdma_comm_core::error::Error;
use rdma_comm_core::reactor::{ConnId, Ctx, DatagramId, DatagramSource, Handler, Idle, SendError};
use rdma_comm_core::verbs::{Gid, UdDestination, UdEndpoint};

use crate::latency::{latency_stats, sample_capacity};
use crate::{BandwidthStats, Clock, DONE_MARKER, LatencyStats, PerfSpec};

/// How long a ping or an end mark waits for its answer before it goes
/// again.
pub const RESEND_AFTER: Duration = Duration::from_millis(100);

/// The first 8 bytes of a stream's end mark (then the count sent).
const END_MARK: u64 = u64::MAX;
/// The first 8 bytes of the server's report (then the count received).
const REPORT_MARK: u64 = u64::MAX - 1;
/// Bytes of an end mark or a report.
const MARK_LEN: usize = 16;
/// Bytes of an encoded [`UdEndpoint`].
const ENDPOINT_LEN: usize = 26;

fn encode(endpoint: &UdEndpoint) -> [u8; ENDPOINT_LEN] {
    let mut out = [0; ENDPOINT_LEN];
    out[..4].copy_from_slice(&endpoint.qpn.to_le_bytes());
    out[4..8].copy_from_slice(&endpoint.qkey.to_le_bytes());
    out[8..24].copy_from_slice(&endpoint.gid.0);
    out[24..].copy_from_slice(&endpoint.lid.to_le_bytes());
    out
}

fn decode(data: &[u8]) -> Option<UdEndpoint> {
    let data: &[u8; ENDPOINT_LEN] = data.try_into().ok()?;
    let word = |at: usize| u32::from_le_bytes([data[at], data[at + 1], data[at + 2], data[at + 3]]);
    let mut gid = [0; 16];
    gid.copy_from_slice(&data[8..24]);
    Some(UdEndpoint {
        qpn: word(0),
        qkey: word(4),
        gid: Gid(gid),
        lid: u16::from_le_bytes([data[24], data[25]]),
    })
}

fn mark(kind: u64, count: u64) -> [u8; MARK_LEN] {
    let mut out = [0; MARK_LEN];
    out[..8].copy_from_slice(&kind.to_le_bytes());
    out[8..].copy_from_slice(&count.to_le_bytes());
    out
}

/// The count a mark of `kind` carries, if `data` is one.
fn read_mark(kind: u64, data: &[u8]) -> Option<u64> {
    let data: &[u8; MARK_LEN] = data.try_into().ok()?;
    let (head, count) = data.split_at(8);
    (head == kind.to_le_bytes()).then(|| u64::from_le_bytes(count.try_into().unwrap_or([0; 8])))
}

/// Writes `seq` into the first bytes of `payload` (as many of its 8 as fit).
#[inline]
fn stamp(payload: &mut [u8], seq: u64) {
    match payload.first_chunk_mut::<8>() {
        Some(head) => *head = seq.to_le_bytes(),
        None => {
            let n = payload.len();
            payload.copy_from_slice(&seq.to_le_bytes()[..n]);
        }
    }
}

/// Whether `data` starts with what [`stamp`] wrote for `seq`.
#[inline]
fn stamped(data: &[u8], seq: u64) -> bool {
    match data.first_chunk::<8>() {
        Some(head) => u64::from_le_bytes(*head) == seq,
        None => data == &seq.to_le_bytes()[..data.len()],
    }
}

/// The session's RC connection, which carries the UD endpoints' addresses
/// each way, then the client's word that the run is over.
#[derive(Debug)]
pub struct UdExchange {
    mine: [u8; ENDPOINT_LEN],
    theirs: Option<UdEndpoint>,
    conn: Option<ConnId>,
    told_done: bool,
    pub(crate) failed: Option<String>,
}

impl UdExchange {
    /// Tells the peer `mine`, once the connection is up.
    pub fn new(mine: UdEndpoint) -> Self {
        Self {
            mine: encode(&mine),
            theirs: None,
            conn: None,
            told_done: false,
            failed: None,
        }
    }

    /// The peer's endpoint, once it came.
    pub fn peer(&self) -> Option<UdEndpoint> {
        self.theirs
    }

    /// The connection, once up.
    pub fn conn(&self) -> Option<ConnId> {
        self.conn
    }

    /// The error that ended the run early, if any.
    pub fn failure(&self) -> Option<&str> {
        self.failed.as_deref()
    }

    /// True once the client said the run is over.
    pub fn is_done(&self) -> bool {
        self.told_done
    }
}

impl Handler for UdExchange {
    fn on_established(&mut self, ctx: &mut Ctx<'_>, conn: ConnId) {
        self.conn = Some(conn);
        if let Err(err) = ctx.send(conn, &self.mine, None) {
            self.failed = Some(err.to_string());
            ctx.stop();
        }
    }

    fn on_message(&mut self, ctx: &mut Ctx<'_>, _conn: ConnId, data: &[u8], imm: Option<u32>) {
        if imm == Some(DONE_MARKER) {
            self.told_done = true;
        } else {
            self.theirs = decode(data);
            if self.theirs.is_none() {
                self.failed = Some("the peer's UD endpoint did not decode".into());
            }
        }
        ctx.stop();
    }

    fn on_error(&mut self, ctx: &mut Ctx<'_>, _conn: ConnId, error: &Error) {
        self.failed = Some(error.to_string());
        ctx.stop();
    }
}

/// Times UD ping-pongs (`latency`) or streams datagrams and asks the
/// server how many arrived (`bandwidth`).
#[derive(Debug)]
pub struct UdClient {
    spec: PerfSpec,
    bandwidth: bool,
    dgram: Option<DatagramId>,
    to: Option<UdDestination>,
    payload: Vec<u8>,
    clock: Clock,
    resend_ticks: u64,
    /// Pings answered, or datagrams staged.
    seq: u64,
    /// When the current ping (or the first datagram, or the last end
    /// mark) went.
    started_at: u64,
    first_at: u64,
    waiting: bool,
    samples: Vec<u64>,
    resent: u64,
    /// The server's count and when it came.
    report: Option<(u64, u64)>,
    pub(crate) failed: Option<String>,
}

impl UdClient {
    fn new(spec: PerfSpec, bandwidth: bool) -> Self {
        let spec = spec.runnable();
        let clock = Clock::new();
        let resend_ticks = (RESEND_AFTER.as_nanos() as f64 / clock.ns_per_tick()) as u64;
        Self {
            spec,
            bandwidth,
            dgram: None,
            to: None,
            payload: vec![0x5a; spec.size],
            clock,
            resend_ticks,
            seq: 0,
            started_at: 0,
            first_at: 0,
            waiting: false,
            samples: if bandwidth {
                Vec::new()
            } else {
                Vec::with_capacity(sample_capacity(&spec))
            },
            resent: 0,
            report: None,
            failed: None,
        }
    }

    /// A latency client: one ping of the spec's size out at a time.
    pub fn latency(spec: PerfSpec) -> Self {
        Self::new(spec, false)
    }

    /// A bandwidth client: `iters` datagrams as fast as the send queue
    /// takes them.
    pub fn bandwidth(spec: PerfSpec) -> Self {
        Self::new(spec, true)
    }

    /// Sends from endpoint `dgram` to `to` from the next pass on.
    pub fn start(&mut self, dgram: DatagramId, to: UdDestination) {
        self.dgram = Some(dgram);
        self.to = Some(to);
    }

    /// The error that ended the run early, if any.
    pub fn failure(&self) -> Option<&str> {
        self.failed.as_deref()
    }

    /// True once every ping was answered, or the server reported.
    pub fn is_done(&self) -> bool {
        if self.bandwidth {
            self.report.is_some()
        } else {
            self.seq >= self.spec.warmup + self.spec.iters
        }
    }

    /// Pings or end marks sent again for want of an answer.
    pub fn resent(&self) -> u64 {
        self.resent
    }

    /// Datagrams the server received (bandwidth).
    pub fn received(&self) -> Option<u64> {
        self.report.map(|(count, _)| count)
    }

    /// The latency columns (half round trips after the warmup).
    pub fn into_latency_stats(mut self) -> Option<LatencyStats> {
        latency_stats(&self.spec, &self.clock, &mut self.samples)
    }

    /// The bandwidth columns: the datagrams sent over the time from the
    /// first to the server's report.
    pub fn stats(&self) -> BandwidthStats {
        let end = self.report.map_or(self.started_at, |(_, at)| at);
        let secs = (self.clock.nanos(self.first_at, end) as f64 / 1e9).max(1e-9);
        let rate = self.seq as f64 / secs;
        BandwidthStats {
            bytes: self.spec.size,
            iters: self.seq,
            peak_bytes_per_sec: rate * self.spec.size as f64,
            avg_bytes_per_sec: rate * self.spec.size as f64,
            msg_rate_mpps: rate / 1e6,
        }
    }

    fn fail(&mut self, ctx: &mut Ctx<'_>, err: SendError) {
        self.failed = Some(err.to_string());
        ctx.stop();
    }

    /// Sends ping `self.seq` (its number in its first bytes), timed from `now`.
    fn ping(&mut self, ctx: &mut Ctx<'_>, now: u64) {
        let (Some(dgram), Some(to)) = (self.dgram, self.to.as_ref()) else {
            return;
        };
        stamp(&mut self.payload, self.seq);
        match ctx.send_datagram(dgram, to, &self.payload) {
            Ok(()) => {
                self.started_at = now;
                self.waiting = true;
            }
            Err(SendError::WouldBlock) => self.waiting = false,
            Err(err) => self.fail(ctx, err),
        }
    }

    /// Stages datagrams until the queue is full or all went; then the end
    /// mark, again and again until the report comes.
    fn stream(&mut self, ctx: &mut Ctx<'_>) {
        let (Some(dgram), Some(to)) = (self.dgram, self.to.as_ref()) else {
            return;
        };
        let total = self.spec.iters;
        if self.seq == 0 {
            self.first_at = self.clock.now();
        }
        while self.seq < total {
            stamp(&mut self.payload, self.seq);
            match ctx.send_datagram(dgram, to, &self.payload) {
                Ok(()) => self.seq += 1,
                Err(SendError::WouldBlock) => return,
                Err(err) => return self.fail(ctx, err),
            }
        }
        let now = self.clock.now();
        if self.waiting && now.saturating_sub(self.started_at) < self.resend_ticks {
            return;
        }
        if self.waiting {
            self.resent += 1;
        }
        match ctx.send_datagram(dgram, to, &mark(END_MARK, total)) {
            Ok(()) => {
                self.waiting = true;
                self.started_at = now;
            }
            Err(SendError::WouldBlock) => {}
            Err(err) => self.fail(ctx, err),
        }
    }
}

impl Handler for UdClient {
    fn on_message(&mut self, _: &mut Ctx<'_>, _: ConnId, _: &[u8], _: Option<u32>) {}

    fn on_datagram(
        &mut self,
        ctx: &mut Ctx<'_>,
        _dgram: DatagramId,
        _source: &DatagramSource<'_>,
        data: &[u8],
    ) {
        if self.bandwidth {
            if let Some(count) = read_mark(REPORT_MARK, data) {
                self.report = Some((count, self.clock.now()));
                ctx.stop();
            }
            return;
        }
        if !self.waiting || data.len() != self.payload.len() || !stamped(data, self.seq) {
            // A late echo of a ping sent again.
            return;
        }
        // One reading ends this round trip and starts the next, as
        // perftest times from post to post.
        let now = self.clock.now();
        self.samples.push(now.saturating_sub(self.started_at));
        self.waiting = false;
        self.seq += 1;
        if self.is_done() {
            ctx.stop();
        } else {
            self.ping(ctx, now);
        }
    }

    fn on_datagram_error(&mut self, ctx: &mut Ctx<'_>, _: DatagramId, error: &Error) {
        self.failed = Some(error.to_string());
        ctx.stop();
    }

    fn on_idle(&mut self, ctx: &mut Ctx<'_>) -> Idle {
        self.when_idle(ctx);
        Idle::Again
    }
}

impl UdClient {
    /// What a pass that finds nothing does for this role.
    fn when_idle(&mut self, ctx: &mut Ctx<'_>) {
        if self.is_done() || self.failed.is_some() {
            return;
        }
        if self.bandwidth {
            return self.stream(ctx);
        }
        if !self.waiting {
            return self.ping(ctx, self.clock.now());
        }
        let now = self.clock.now();
        if now.saturating_sub(self.started_at) >= self.resend_ticks {
            self.resent += 1;
            self.ping(ctx, now);
        }
    }
}

/// Echoes each ping (`latency`), or counts datagrams and answers an end
/// mark with how many came (`bandwidth`).
#[derive(Debug)]
pub struct UdServer {
    bandwidth: bool,
    to: Option<UdDestination>,
    received: u64,
    pub(crate) failed: Option<String>,
}

impl UdServer {
    /// A server for a latency (`bandwidth` false) or bandwidth client.
    pub fn new(bandwidth: bool) -> Self {
        Self {
            bandwidth,
            to: None,
            received: 0,
            failed: None,
        }
    }

    /// Answers to `to` from the next pass on.
    pub fn start(&mut self, to: UdDestination) {
        self.to = Some(to);
    }

    /// The error that ended the run early, if any.
    pub fn failure(&self) -> Option<&str> {
        self.failed.as_deref()
    }

    /// A server ends when the client says so (over the session).
    pub fn is_done(&self) -> bool {
        false
    }
}

impl Handler for UdServer {
    fn on_message(&mut self, _: &mut Ctx<'_>, _: ConnId, _: &[u8], _: Option<u32>) {}

    fn on_datagram(
        &mut self,
        ctx: &mut Ctx<'_>,
        dgram: DatagramId,
        _source: &DatagramSource<'_>,
        data: &[u8],
    ) {
        let Some(to) = self.to.as_ref() else { return };
        let answer = if !self.bandwidth {
            ctx.send_datagram(dgram, to, data)
        } else if read_mark(END_MARK, data).is_some() {
            ctx.send_datagram(dgram, to, &mark(REPORT_MARK, self.received))
        } else {
            self.received += 1;
            return;
        };
        // A full send queue drops the answer, as the network may: the
        // client sends again.
        if let Err(err @ (SendError::Closed | SendError::Invalid(_) | SendError::TooLarge { .. })) =
            answer
        {
            self.failed = Some(err.to_string());
            ctx.stop();
        }
    }

    fn on_datagram_error(&mut self, ctx: &mut Ctx<'_>, _: DatagramId, error: &Error) {
        self.failed = Some(error.to_string());
        ctx.stop();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_endpoint_and_the_marks_round_trip() {
        let endpoint = UdEndpoint {
            qpn: 0x12_3456,
            qkey: 0x1111_2222,
            gid: Gid([7; 16]),
            lid: 9,
        };
        assert_eq!(decode(&encode(&endpoint)), Some(endpoint));
        assert_eq!(decode(&[0; 25]), None, "too short");
        assert_eq!(read_mark(END_MARK, &mark(END_MARK, 42)), Some(42));
        assert_eq!(read_mark(REPORT_MARK, &mark(END_MARK, 42)), None);
        assert_eq!(read_mark(END_MARK, &[0xff; 8]), None, "too short");
        for len in [1, 7, 8, 64] {
            let mut payload = vec![0; len];
            stamp(&mut payload, 0x0102_0304_0506_0708);
            assert!(stamped(&payload, 0x0102_0304_0506_0708), "{len}");
            assert!(!stamped(&payload, 0x0102_0304_0506_0700), "{len}");
        }
    }
}
