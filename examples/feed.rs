//! A market-data style feed over RDMA multicast: a publisher sends
//! numbered datagrams to a group once each, and every subscriber counts
//! what it got, the gaps (UD drops datagrams under loss; a gap is counted
//! and reported, never waited for), any datagram that came back altered,
//! and how long each took from publisher to subscriber.
//!
//! ```text
//! feed publish --group 239.1.1.1 [--count 1000] [--rate 10000] [--size 64] [-d DEV] [-x GID | --cm ADDR]
//! feed subscribe --group 239.1.1.1 [--timeout 30] [--count N [--raw]] [--receives 256] [--json] [-d DEV] [-x GID | --cm ADDR]
//! ```
//!
//! By default each side is a datagram endpoint of a reactor
//! (`Reactor::add_datagram`): the publisher sends from `on_idle`, paced, and
//! the subscriber counts in `on_datagram`; the endpoint is attached to the
//! group directly (`Reactor::join`: `ibv_attach_mcast`, with this host's IP
//! membership of the group held through a socket). With `--cm ADDR` both
//! sides join through the connection manager (`rdma_join_multicast`) from
//! the local address ADDR, as rdma-core's `mckey -b ADDR` does, on a UD QP
//! of the connection manager's id, and send to where the join event says
//! the group is.
//!
//! A datagram carries its sequence number, the publisher's clock when it
//! was sent (nanoseconds since the Unix epoch, `CLOCK_REALTIME`) and a
//! pattern of the number; after the last one the publisher sends an end
//! mark, with the count, a few times. A subscriber stops at the end mark (or
//! at `--timeout` seconds without one) and prints one line (or a JSON
//! object): received, gaps, missing, late, altered, and the one-way latency
//! (its own clock at the receive minus the send time) at p50, p99, p99.9 and
//! max, with a count of the datagrams received before they were sent by
//! those clocks (skewed: the hosts' clocks differ), which the percentiles
//! leave out. The latencies are only as good as the two clocks' agreement:
//! meaningful on one host, or across hosts synchronised with PTP. It exits
//! non-zero if it received nothing or anything altered.

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::process::ExitCode;
use std::time::{Duration, Instant, SystemTime};

mod common;
#[path = "common/rtt.rs"]
mod rtt;

use clap::{Parser, Subcommand};
use rdma_comm_core::reactor::{
    ConnId, Ctx, DatagramId, DatagramSource, Handler, Reactor, ReactorConfig, SendError,
};
use rdma_comm_core::verbs::cm::{CmEventKind, CmId, EventChannel};
use rdma_comm_core::verbs::*;
use rtt::RttRecorder;

/// Multicast feed: publish numbered datagrams to a group, or subscribe and
/// count them.
#[derive(Parser, Debug)]
#[command(version)]
struct Args {
    #[command(subcommand)]
    role: Role,
}

#[derive(Subcommand, Debug)]
enum Role {
    /// Send `--count` datagrams to the group, once each.
    Publish {
        #[command(flatten)]
        group: GroupArgs,
        /// Datagrams to send, 1 to 10^9.
        #[arg(long, default_value_t = 1000, value_parser = common::range(1u64, 1_000_000_000))]
        count: u64,
        /// Datagrams per second, 1 to 10^7.
        #[arg(long, default_value_t = 10_000, value_parser = common::range(1u64, 10_000_000))]
        rate: u64,
        /// Bytes per datagram, 24 to 4096 (and at most the port's MTU): the
        /// sequence number, the send time and at least 8 bytes of pattern.
        #[arg(long, default_value_t = 64, value_parser = common::range(MIN_SIZE, 4096))]
        size: usize,
    },
    /// Join the group and count what arrives.
    Subscribe {
        #[command(flatten)]
        group: GroupArgs,
        /// Seconds to wait for the end mark, 1 to 86400.
        #[arg(long, default_value_t = 30, value_parser = common::range(1u64, 86_400))]
        timeout: u64,
        /// One JSON object instead of the summary line.
        #[arg(long)]
        json: bool,
        /// Take the datagrams as they are, without a sequence number, a send
        /// time or a pattern (another publisher's, such as rdma-core's
        /// `mckey -s`): count them, and stop after `--count` of them.
        #[arg(long, requires = "count")]
        raw: bool,
        /// Stop after this many datagrams, 1 to 10^12 (default: at the end
        /// mark).
        #[arg(long, value_parser = common::range(1u64, 1_000_000_000_000))]
        count: Option<u64>,
        /// Receives kept posted, 1 to 8192, each room for the largest
        /// datagram (4 KiB). A datagram that arrives while none is posted is
        /// dropped, so this many datagrams is the most the subscriber may
        /// fall behind the feed.
        #[arg(long, default_value_t = RECEIVES, value_parser = common::range(1usize, MAX_RECEIVES))]
        receives: usize,
    },
}

#[derive(clap::Args, Debug)]
struct GroupArgs {
    /// The multicast group, an IPv4 address in 224.0.0.0/4.
    #[arg(long, value_parser = multicast_group)]
    group: Ipv4Addr,
    /// RDMA device (default: the first with an active port).
    #[arg(short = 'd', long)]
    device: Option<String>,
    /// GID index (default: the RoCE v2 IPv4-mapped GID).
    #[arg(short = 'x', long)]
    gid_index: Option<u32>,
    /// Join through the connection manager (rdma_cm), as rdma-core's
    /// mckey does, from ADDR, this host's IPv4 address on the device to
    /// use (mckey's -b); the device is the one ADDR is on, so neither -d
    /// nor -x goes with it.
    #[arg(long, value_name = "ADDR", value_parser = local_address)]
    cm: Option<Ipv4Addr>,
}

fn multicast_group(text: &str) -> Result<Ipv4Addr, String> {
    match text.parse::<Ipv4Addr>() {
        Ok(group) if group.is_multicast() => Ok(group),
        _ => Err("must be an IPv4 multicast address (224.0.0.0/4)".into()),
    }
}

fn local_address(text: &str) -> Result<Ipv4Addr, String> {
    match text.parse::<Ipv4Addr>() {
        Ok(addr) if !addr.is_unspecified() && !addr.is_multicast() && !addr.is_broadcast() => {
            Ok(addr)
        }
        _ => Err("must be an IPv4 address of this host (mckey's -b)".into()),
    }
}

/// Refuses what the flags cannot mean together, before anything is opened.
fn check(group: &GroupArgs) -> Result<(), common::Refusal> {
    if group.cm.is_some() && (group.device.is_some() || group.gid_index.is_some()) {
        return Err(common::Refusal::of(
            "--cm",
            "the device and GID are those of its address: give no -d or -x with it",
        ));
    }
    Ok(())
}

/// The sequence number of the end mark.
const END: u64 = u64::MAX;
/// Where a datagram's send time is: after its sequence number.
const SENT_AT: usize = 8;
/// Where the pattern starts (and, in the end mark, the count).
const PATTERN_AT: usize = 16;
/// The smallest datagram: the sequence number, the send time, and the end
/// mark's count where the others have their pattern.
const MIN_SIZE: usize = PATTERN_AT + 8;
/// How long the connection manager may take to resolve the group's
/// address from the local one (mckey's 2 s).
const RESOLVE_TIMEOUT: Duration = Duration::from_secs(2);
/// How long to wait for the connection manager's answer to a resolve or a
/// join.
const CM_WAIT: Duration = Duration::from_secs(10);
/// How many times the end mark goes out (UD may drop some).
const END_REPEATS: u32 = 5;
/// How long a publisher's reactor keeps running after its last datagram
/// was staged, so the send queue empties before the QP is destroyed.
const LINGER: Duration = Duration::from_millis(100);
/// Time between the end marks.
const END_SPACING: Duration = Duration::from_millis(2);
/// Receives kept posted by default, each the GRH and the largest datagram.
const RECEIVES: usize = 256;
/// The most `--receives` takes: its CQ (twice as deep) stays within what
/// Soft-RoCE allows (32767 entries), and its buffers within 34 MiB.
const MAX_RECEIVES: usize = 8192;
const RECV_LEN: usize = GRH_BYTES + 4096;

fn main() -> ExitCode {
    common::init_logging();
    let args: Args = common::parse("feed");
    let (Role::Publish { group, .. } | Role::Subscribe { group, .. }) = &args.role;
    if let Err(refusal) = check(group) {
        return refusal.exit("feed");
    }
    let outcome = match args.role {
        Role::Publish {
            group,
            count,
            rate,
            size,
        } if group.cm.is_none() => publish_from_reactor(&group, count, rate, size),
        Role::Publish {
            group,
            count,
            rate,
            size,
        } => publish(&group, count, rate, size),
        Role::Subscribe {
            group,
            timeout,
            json,
            raw,
            count,
            receives,
        } if group.cm.is_none() => subscribe_on_reactor(
            &group,
            Duration::from_secs(timeout),
            Sink::new(raw, count),
            receives,
        )
        .map(|sink| sink.report(&group, json)),
        Role::Subscribe {
            group,
            timeout,
            json,
            raw,
            count,
            receives,
        } => subscribe(
            &group,
            Duration::from_secs(timeout),
            json,
            raw,
            count,
            receives,
        ),
    };
    match outcome {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::FAILURE,
        Err(err) => {
            eprintln!("feed: {err}");
            ExitCode::FAILURE
        }
    }
}

/// A member of the group: a UD QP with a CQ of its own, and with
/// `--cm` the connection manager's id it was created on.
struct Member {
    qp: UdQueuePair,
    cq: CompletionQueue,
    pd: ProtectionDomain,
    cm: Option<Cm>,
}

/// The connection manager's id of a `--cm` member, and its channel.
struct Cm {
    channel: EventChannel,
    id: CmId,
}

impl Cm {
    /// Joins `group` for `qp` and waits for the join, which attaches the
    /// QP; where to send to the group.
    fn join(&self, qp: &mut UdQueuePair, group: Ipv4Addr) -> rdma_comm_core::Result<UdDestination> {
        self.id.join_multicast(qp, IpAddr::V4(group))?;
        let joined = self
            .channel
            .expect(&self.id, CmEventKind::MulticastJoin, CM_WAIT)?;
        joined.attach_group(qp)
    }
}

impl Member {
    /// Where to send to the group: its GID, or with `--cm` where the join
    /// event says it is (the QP joins it for that).
    fn group_destination(&mut self, group: Ipv4Addr) -> rdma_comm_core::Result<UdDestination> {
        match &self.cm {
            None => self.qp.group_destination(Gid::from_ipv4(group)),
            Some(cm) => cm.join(&mut self.qp, group),
        }
    }

    /// Receives the group's datagrams from now on.
    fn subscribe(&mut self, group: Ipv4Addr) -> rdma_comm_core::Result<()> {
        match &self.cm {
            None => self.qp.join(Gid::from_ipv4(group)),
            Some(cm) => {
                cm.join(&mut self.qp, group)?;
                Ok(())
            }
        }
    }
}

/// A member with `receives` posted receives: on the chosen device, or
/// with `--cm` on an id bound to the local address's device, which has
/// resolved the group's address from it (as mckey does).
fn open(group: &GroupArgs, receives: usize) -> rdma_comm_core::Result<Member> {
    let (ctx, cm) = match group.cm {
        None => (Context::open_default(group.device.as_deref())?, None),
        Some(local) => {
            let channel = EventChannel::new()?;
            let mut id = channel.create_ud_id()?;
            let local = SocketAddr::from((local, 0));
            id.bind(local)?;
            id.resolve_addr(
                Some(local),
                SocketAddr::from((group.group, 0)),
                RESOLVE_TIMEOUT,
            )?;
            channel.expect(&id, CmEventKind::AddrResolved, CM_WAIT)?;
            (id.context()?, Some(Cm { channel, id }))
        }
    };
    let pd = ctx.alloc_pd()?;
    let cq = ctx.create_cq(2 * receives as u32, None)?;
    let config = UdConfig {
        max_recv_wr: receives as u32,
        gid_index: group.gid_index,
        ..UdConfig::default()
    };
    let qp = match &cm {
        None => pd.create_ud_qp(&cq, &cq, &config)?,
        Some(cm) => cm.id.create_ud_qp(&pd, &cq, &cq, &config)?,
    };
    Ok(Member { qp, cq, pd, cm })
}

/// Datagram `seq`'s bytes: its number, the send time `sent_ns`, then a
/// pattern of the number.
fn fill(datagram: &mut [u8], seq: u64, sent_ns: u64) {
    datagram[..SENT_AT].copy_from_slice(&seq.to_le_bytes());
    stamp(datagram, sent_ns);
    fill_pattern(&mut datagram[PATTERN_AT..], seq);
}

/// Writes the send time into a filled datagram.
fn stamp(datagram: &mut [u8], sent_ns: u64) {
    datagram[SENT_AT..PATTERN_AT].copy_from_slice(&sent_ns.to_le_bytes());
}

fn fill_pattern(pattern: &mut [u8], seq: u64) {
    for (i, byte) in pattern.iter_mut().enumerate() {
        *byte = (seq as u8).wrapping_mul(31).wrapping_add(i as u8);
    }
}

/// The little-endian number at `at` in `bytes`; 0 where `bytes` is too
/// short (the callers check the length first, so this is never hit).
fn word(bytes: &[u8], at: usize) -> u64 {
    bytes
        .get(at..at + 8)
        .and_then(|word| word.try_into().ok())
        .map_or(0, u64::from_le_bytes)
}

/// This host's `CLOCK_REALTIME` in nanoseconds since the Unix epoch: the
/// clock two hosts can agree on (through NTP or PTP), unlike a monotonic
/// one, which starts at each host's boot.
fn realtime_ns() -> u64 {
    SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0, |since| {
            u64::try_from(since.as_nanos()).unwrap_or(u64::MAX)
        })
}

fn publish(args: &GroupArgs, count: u64, rate: u64, size: usize) -> rdma_comm_core::Result<bool> {
    let mut member = open(args, RECEIVES)?;
    if size > member.qp.max_datagram() as usize {
        eprintln!(
            "feed: --size {size}: larger than the port's MTU ({} B)",
            member.qp.max_datagram()
        );
        return Ok(false);
    }
    let mut tx = member.pd.alloc_mr(size, AccessFlags::empty())?;
    let to_group = member.group_destination(args.group)?;
    let Member { mut qp, mut cq, .. } = member;
    let interval = Duration::from_secs_f64(1.0 / rate as f64);
    let mut datagram = vec![0; size];
    let started = Instant::now();
    let mut wcs = [WorkCompletion::default(); 4];
    for seq in (0..count).chain(std::iter::repeat_n(END, END_REPEATS as usize)) {
        let due = started + interval.mul_f64(seq.min(count) as f64);
        while Instant::now() < due {
            std::hint::spin_loop();
        }
        fill(&mut datagram, seq, 0);
        if seq == END {
            datagram[PATTERN_AT..MIN_SIZE].copy_from_slice(&count.to_le_bytes());
        }
        // The clock is read last, just before the datagram goes to the
        // registered buffer and the post: the latency a subscriber measures
        // leaves out the publisher's pacing and filling.
        stamp(&mut datagram, realtime_ns());
        tx.write(0, &datagram)?;
        // Signaled, and waited for, so the send buffer may be rewritten.
        let mut request = UdSend::new(seq, tx.slice(0, size)?, &to_group).signaled();
        qp.post_send(&mut request)?;
        loop {
            if let Some(wc) = cq.poll(&mut wcs)?.first() {
                wc.ok()?;
                break;
            }
        }
    }
    let secs = started.elapsed().as_secs_f64();
    println!(
        "published {count} datagrams of {size} B to {} in {secs:.2} s ({:.0}/s)",
        args.group,
        count as f64 / secs
    );
    Ok(true)
}

/// One-way latencies: the subscriber's clock at the receive minus the send
/// time the datagram carries, in constant memory.
#[derive(Debug, Default)]
struct Latency {
    /// The latencies of the datagrams received after they were sent.
    times: RttRecorder,
    /// Datagrams received before their send time by the two clocks: the
    /// hosts' clocks differ by more than the latency. Kept out of the
    /// percentiles, which have no negative times.
    skewed: u64,
}

impl Latency {
    fn record(&mut self, sent_ns: u64, received_ns: u64) {
        match received_ns.checked_sub(sent_ns) {
            Some(ns) => self.times.record(ns),
            None => self.skewed += 1,
        }
    }

    /// p50, p99, p99.9 and max in microseconds; `None` when no datagram
    /// was timed (none received, all skewed, or `--raw`).
    fn percentiles_us(&self) -> Option<[f64; 4]> {
        (self.times.count() > 0).then(|| [0.5, 0.99, 0.999, 1.0].map(|q| self.times.quantile_us(q)))
    }

    /// The summary line's part: `one-way us: p50 A p99 B p99.9 C max D, N
    /// skewed`.
    fn text(&self) -> String {
        match self.percentiles_us() {
            Some([p50, p99, p999, max]) => format!(
                "one-way us: p50 {p50:.2} p99 {p99:.2} p99.9 {p999:.2} max {max:.2}, {} skewed",
                self.skewed
            ),
            None => format!("one-way us: none timed, {} skewed", self.skewed),
        }
    }

    /// The JSON object's members: `"p50_us":A,...,"skewed":N` (`null`s when
    /// nothing was timed).
    fn json(&self) -> String {
        let [p50, p99, p999, max] = match self.percentiles_us() {
            Some(us) => us.map(|us| format!("{us:.3}")),
            None => std::array::from_fn(|_| "null".to_string()),
        };
        format!(
            "\"p50_us\":{p50},\"p99_us\":{p99},\"p999_us\":{p999},\"max_us\":{max},\"skewed\":{}",
            self.skewed
        )
    }
}

/// What a subscriber counted.
#[derive(Debug, Default)]
struct Tally {
    received: u64,
    /// Jumps in the sequence: runs of datagrams that never came.
    gaps: u64,
    /// Datagrams the gaps skipped.
    missing: u64,
    /// Datagrams older than one already seen (reordered or repeated).
    late: u64,
    /// Datagrams whose bytes were not the pattern of their number, or too
    /// short to hold one.
    altered: u64,
    next: u64,
    latency: Latency,
}

impl Tally {
    /// The publisher sent `total`: those after the last one seen are missing.
    fn end(&mut self, total: u64) {
        if total > self.next {
            self.gaps += 1;
            self.missing += total - self.next;
            self.next = total;
        }
    }

    /// Counts a datagram other than the end mark, received at `received_ns`
    /// by this host's clock. Its send time is the publisher's word, checked
    /// by nothing: a pattern cannot cover a clock reading.
    fn count(&mut self, datagram: &[u8], expected: &mut Vec<u8>, received_ns: u64) {
        if datagram.len() < MIN_SIZE {
            self.altered += 1;
            return;
        }
        let seq = word(datagram, 0);
        expected.resize(datagram.len() - PATTERN_AT, 0);
        fill_pattern(expected, seq);
        if datagram[PATTERN_AT..] != expected[..] {
            self.altered += 1;
            return;
        }
        self.received += 1;
        self.latency.record(word(datagram, SENT_AT), received_ns);
        if seq < self.next {
            self.late += 1;
            return;
        }
        if seq > self.next {
            self.gaps += 1;
            self.missing += seq - self.next;
        }
        self.next = seq + 1;
    }
}

/// The end mark's count, when `datagram` is an end mark.
fn end_mark(datagram: &[u8]) -> Option<u64> {
    (datagram.len() >= MIN_SIZE && word(datagram, 0) == END).then(|| word(datagram, PATTERN_AT))
}

/// What a subscriber does with each datagram, on either path: counts it
/// (raw, or checked against its number's pattern and timed), and says when
/// to stop.
struct Sink {
    raw: bool,
    count: Option<u64>,
    tally: Tally,
    expected: Vec<u8>,
    first: Option<Instant>,
    ended: bool,
}

impl Sink {
    fn new(raw: bool, count: Option<u64>) -> Self {
        Self {
            raw,
            count,
            tally: Tally::default(),
            expected: Vec::with_capacity(4096),
            first: None,
            ended: false,
        }
    }

    /// Takes one received datagram's payload (`None`: a completion that
    /// carried none), received at `received_ns` by this host's clock.
    fn take(&mut self, payload: Option<&[u8]>, received_ns: u64) {
        match payload {
            // Any payload counts; its length is the completion's.
            Some(_) if self.raw => {
                self.first.get_or_insert_with(Instant::now);
                self.tally.received += 1;
            }
            Some(bytes) => {
                if let Some(total) = end_mark(bytes) {
                    // It says how many were published: the last ones may be missing too.
                    self.tally.end(total);
                    self.ended = true;
                } else {
                    self.first.get_or_insert_with(Instant::now);
                    self.tally.count(bytes, &mut self.expected, received_ns);
                }
            }
            None if self.raw => {}
            None => self.tally.altered += 1,
        }
        if self.count.is_some_and(|count| self.tally.received >= count) {
            self.ended = true;
        }
    }

    /// Prints the summary line (or the JSON object); true if anything
    /// came and nothing came altered.
    fn report(&self, args: &GroupArgs, json: bool) -> bool {
        let tally = &self.tally;
        let ended = self.ended;
        let secs = self
            .first
            .map_or(0.0, |first| first.elapsed().as_secs_f64());
        let rate = if secs > 0.0 {
            tally.received as f64 / secs
        } else {
            0.0
        };
        if json {
            println!(
                "{{\"group\":\"{}\",\"received\":{},\"gaps\":{},\"missing\":{},\"late\":{},\"altered\":{},\"ended\":{ended},\"rate\":{rate:.0},{}}}",
                args.group,
                tally.received,
                tally.gaps,
                tally.missing,
                tally.late,
                tally.altered,
                tally.latency.json()
            );
        } else {
            println!(
                "received {} datagrams from {}: {} gaps ({} missing), {} late, {} altered, {} ({rate:.0}/s); {}",
                tally.received,
                args.group,
                tally.gaps,
                tally.missing,
                tally.late,
                tally.altered,
                if ended {
                    "ended"
                } else {
                    "no end mark before the timeout"
                },
                tally.latency.text(),
            );
        }
        tally.received > 0 && tally.altered == 0
    }
}

/// A feed's side on a reactor's datagram endpoint.
enum FeedHandler {
    Publisher(Publisher),
    Subscriber(Sink),
}

/// Sends `count` datagrams to the group at `rate`, then the end mark.
struct Publisher {
    dgram: DatagramId,
    to: UdDestination,
    count: u64,
    interval: Duration,
    started: Option<Instant>,
    /// The next datagram's number (the end marks count on past `count`).
    seq: u64,
    datagram: Vec<u8>,
    /// The run was asked to stop (once: the linger after it runs on).
    stopped: bool,
}

impl Publisher {
    fn is_done(&self) -> bool {
        self.seq >= self.count + u64::from(END_REPEATS)
    }

    /// When the next datagram is due: paced at the rate, and the end
    /// marks after the last one [`END_SPACING`] apart, so one lost burst
    /// does not take them all.
    fn due(&self, started: Instant) -> Instant {
        let last = started + self.interval.mul_f64(self.seq.min(self.count) as f64);
        let marks = self.seq.saturating_sub(self.count) as u32;
        last + END_SPACING * marks
    }
}

impl Handler for FeedHandler {
    fn on_message(&mut self, _: &mut Ctx<'_>, _: ConnId, _: &[u8], _: Option<u32>) {}

    fn on_datagram(
        &mut self,
        ctx: &mut Ctx<'_>,
        _: DatagramId,
        _: &DatagramSource<'_>,
        data: &[u8],
    ) {
        if let Self::Subscriber(sink) = self {
            // Read first: the time it came, not when it was looked at.
            sink.take(Some(data), realtime_ns());
            if sink.ended {
                ctx.stop();
            }
        }
    }

    fn on_datagram_error(
        &mut self,
        ctx: &mut Ctx<'_>,
        _: DatagramId,
        error: &rdma_comm_core::Error,
    ) {
        eprintln!("feed: the endpoint failed: {error}");
        ctx.stop();
    }

    fn on_idle(&mut self, ctx: &mut Ctx<'_>) {
        let Self::Publisher(publisher) = self else {
            return;
        };
        let (dgram, to) = (publisher.dgram, &publisher.to);
        let started = *publisher.started.get_or_insert_with(Instant::now);
        while !publisher.is_done() {
            if Instant::now() < publisher.due(started) {
                return;
            }
            let (count, datagram) = (publisher.count, &mut publisher.datagram);
            if publisher.seq < count {
                fill(datagram, publisher.seq, 0);
            } else {
                fill(datagram, END, 0);
                datagram[PATTERN_AT..MIN_SIZE].copy_from_slice(&count.to_le_bytes());
            }
            // The clock is read last, just before the datagram is copied
            // into its send slot: the latency a subscriber measures leaves
            // out the publisher's pacing and filling.
            stamp(datagram, realtime_ns());
            match ctx.send_datagram(dgram, to, datagram) {
                Ok(()) => publisher.seq += 1,
                // The queue is full: the next pass tries again.
                Err(SendError::WouldBlock) => return,
                Err(err) => {
                    eprintln!("feed: a datagram was refused: {err}");
                    publisher.stopped = true;
                    ctx.stop();
                    return;
                }
            }
        }
        // Once: the run that lingers after this one keeps the reactor going.
        if !publisher.stopped {
            publisher.stopped = true;
            ctx.stop();
        }
    }
}

/// A reactor with one datagram endpoint of `receives` receives for `handler`.
fn feed_reactor(
    group: &GroupArgs,
    receives: u32,
    make: impl FnOnce(DatagramId, &UdQueuePair) -> rdma_comm_core::Result<FeedHandler>,
) -> rdma_comm_core::Result<(Reactor<FeedHandler>, DatagramId)> {
    let ctx = Context::open_default(group.device.as_deref())?;
    let pd = ctx.alloc_pd()?;
    let sends = UdConfig::default().max_send_wr;
    let config = ReactorConfig {
        cq_size: (receives + sends).max(ReactorConfig::default().cq_size),
        peer_check_interval: None,
        ..ReactorConfig::default()
    };
    let mut reactor = Reactor::new(&pd, config)?;
    let config = UdConfig {
        max_recv_wr: receives,
        gid_index: group.gid_index,
        ..UdConfig::default()
    };
    let dgram = reactor.add_datagram(&config, make)?;
    Ok((reactor, dgram))
}

fn publish_from_reactor(
    args: &GroupArgs,
    count: u64,
    rate: u64,
    size: usize,
) -> rdma_comm_core::Result<bool> {
    let group = Gid::from_ipv4(args.group);
    let made = feed_reactor(args, 1, |dgram, qp| {
        if size > qp.max_datagram() as usize {
            return Err(rdma_comm_core::Error::InvalidArgument(
                "--size: larger than the port's MTU",
            ));
        }
        Ok(FeedHandler::Publisher(Publisher {
            dgram,
            to: qp.group_destination(group)?,
            count,
            interval: Duration::from_secs_f64(1.0 / rate as f64),
            started: None,
            seq: 0,
            datagram: vec![0; size],
            stopped: false,
        }))
    });
    let (mut reactor, dgram) = match made {
        Err(rdma_comm_core::Error::InvalidArgument(why)) if why.starts_with("--size") => {
            eprintln!("feed: --size {size}: larger than the port's MTU");
            return Ok(false);
        }
        made => made?,
    };
    let started = Instant::now();
    reactor.run()?;
    let secs = started.elapsed().as_secs_f64();
    // The last datagrams leave the send queue before the QP goes.
    let _reached = reactor.run_for(LINGER)?;
    let done =
        matches!(reactor.datagram_handler(dgram), Some(FeedHandler::Publisher(p)) if p.is_done());
    if done {
        println!(
            "published {count} datagrams of {size} B to {} in {secs:.2} s ({:.0}/s)",
            args.group,
            count as f64 / secs
        );
    }
    Ok(done)
}

fn subscribe_on_reactor(
    args: &GroupArgs,
    timeout: Duration,
    sink: Sink,
    receives: usize,
) -> rdma_comm_core::Result<Sink> {
    let (mut reactor, dgram) = feed_reactor(args, receives as u32, |_, _| {
        Ok(FeedHandler::Subscriber(sink))
    })?;
    reactor.join(dgram, Gid::from_ipv4(args.group))?;
    eprintln!("feed: subscribed to {}", args.group);
    let _ended = reactor.run_for(timeout)?;
    let handler = reactor.datagram_handler_mut(dgram);
    match handler
        .map(|handler| std::mem::replace(handler, FeedHandler::Subscriber(Sink::new(false, None))))
    {
        Some(FeedHandler::Subscriber(sink)) => Ok(sink),
        _ => Err(rdma_comm_core::Error::InvalidArgument(
            "the subscriber vanished",
        )),
    }
}

/// `--cm`'s subscriber: a UD QP of the connection manager's id, polled here.
fn subscribe(
    args: &GroupArgs,
    timeout: Duration,
    json: bool,
    raw: bool,
    count: Option<u64>,
    receives: usize,
) -> rdma_comm_core::Result<bool> {
    let mut member = open(args, receives)?;
    let rx = member
        .pd
        .alloc_mr(receives * RECV_LEN, AccessFlags::LOCAL_WRITE)?;
    for slot in 0..receives {
        member.qp.post_recv(&mut RecvRequest::new(
            slot as u64,
            rx.slice(slot * RECV_LEN, RECV_LEN)?,
        )?)?;
    }
    member.subscribe(args.group)?;
    eprintln!("feed: subscribed to {} through rdma_cm", args.group);
    let Member { mut qp, mut cq, .. } = member;
    let mut sink = Sink::new(raw, count);
    let mut datagram = vec![0; RECV_LEN];
    let mut wcs = [WorkCompletion::default(); 32];
    let started = Instant::now();
    while !sink.ended && started.elapsed() < timeout {
        for wc in cq.poll(&mut wcs)? {
            // Read per completion, not per poll: a batch of 32 may have
            // arrived over a while.
            let received_ns = realtime_ns();
            wc.ok()?;
            let slot = wc.wr_id() as usize;
            let payload = match datagram_payload(wc) {
                Some(payload) => {
                    let bytes = &mut datagram[..payload.len()];
                    rx.read(slot * RECV_LEN + payload.start, bytes)?;
                    Some(&bytes[..])
                }
                None => None,
            };
            sink.take(payload, received_ns);
            qp.post_recv(&mut RecvRequest::new(
                slot as u64,
                rx.slice(slot * RECV_LEN, RECV_LEN)?,
            )?)?;
        }
    }
    Ok(sink.report(args, json))
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    /// Datagram `seq` of `size` bytes, sent at `sent_ns`.
    fn datagram(seq: u64, sent_ns: u64, size: usize) -> Vec<u8> {
        let mut bytes = vec![0; size];
        fill(&mut bytes, seq, sent_ns);
        bytes
    }

    #[test]
    fn a_datagram_carries_its_number_its_send_time_and_a_pattern() {
        let bytes = datagram(7, 1_234_567_890, 64);
        assert_eq!(word(&bytes, 0), 7);
        assert_eq!(word(&bytes, SENT_AT), 1_234_567_890);
        let mut tally = Tally::default();
        tally.count(&bytes, &mut Vec::new(), 1_234_567_890 + 52_000);
        assert_eq!((tally.received, tally.altered), (1, 0));
        assert_eq!(tally.latency.times.count(), 1);
        assert_eq!(tally.latency.times.quantile_ns(1.0), 52_000);
        assert_eq!(end_mark(&bytes), None);
    }

    #[test]
    fn the_smallest_datagram_and_the_end_mark_fit_in_24_bytes() {
        assert_eq!(MIN_SIZE, 24);
        let mut mark = datagram(END, 5, MIN_SIZE);
        mark[PATTERN_AT..MIN_SIZE].copy_from_slice(&1000u64.to_le_bytes());
        assert_eq!(end_mark(&mark), Some(1000));
        assert_eq!(end_mark(&mark[..MIN_SIZE - 1]), None);
        let mut tally = Tally::default();
        tally.count(&datagram(0, 5, MIN_SIZE), &mut Vec::new(), 6);
        assert_eq!((tally.received, tally.altered), (1, 0));
    }

    #[test]
    fn a_short_or_changed_datagram_counts_as_altered_and_is_not_timed() {
        let mut tally = Tally::default();
        let mut expected = Vec::new();
        for len in [0, 1, 8, 16, MIN_SIZE - 1] {
            tally.count(&datagram(0, 0, 64)[..len], &mut expected, 1);
        }
        let mut changed = datagram(0, 0, 64);
        changed[40] ^= 1;
        tally.count(&changed, &mut expected, 1);
        assert_eq!((tally.received, tally.altered), (0, 6));
        assert_eq!(tally.latency.times.count(), 0);
        // The send time is the publisher's word: nothing covers it.
        tally.count(&datagram(0, u64::MAX, 64), &mut expected, 1);
        assert_eq!((tally.received, tally.altered), (1, 6));
    }

    #[test]
    fn gaps_missing_and_late_datagrams_are_counted_and_every_one_received_is_timed() {
        let mut tally = Tally::default();
        let mut expected = Vec::new();
        for seq in [0, 1, 3, 2, 7, 8] {
            tally.count(
                &datagram(seq, 100, 32),
                &mut expected,
                100 + 1_000 * (seq + 1),
            );
        }
        tally.end(12);
        assert_eq!(tally.received, 6);
        assert_eq!(tally.gaps, 3, "before 3, before 7, after 8");
        assert_eq!(tally.missing, 1 + 3 + 3);
        assert_eq!(tally.late, 1);
        assert_eq!(tally.latency.times.count(), 6);
        assert_eq!(tally.latency.times.quantile_ns(0.0), 1_000);
        assert_eq!(tally.latency.times.quantile_ns(1.0), 9_000);
    }

    #[test]
    fn a_datagram_received_before_its_send_time_is_skewed_and_left_out() {
        let mut latency = Latency::default();
        latency.record(2_000, 1_000);
        assert_eq!((latency.skewed, latency.times.count()), (1, 0));
        assert_eq!(latency.percentiles_us(), None);
        assert_eq!(latency.text(), "one-way us: none timed, 1 skewed");
        latency.record(2_000, 2_000);
        latency.record(0, u64::MAX);
        assert_eq!((latency.skewed, latency.times.count()), (1, 2));
        let [p50, _, _, max] = latency.percentiles_us().unwrap();
        assert_eq!(p50, 0.0);
        assert_eq!(max, u64::MAX as f64 / 1e3, "the maximum stays exact");
    }

    #[test]
    fn the_percentiles_come_out_in_microseconds_in_the_line_and_the_json() {
        let mut latency = Latency::default();
        for us in 1..=1000u64 {
            latency.record(10, 10 + us * 1_000);
        }
        latency.record(5, 4);
        let [p50, p99, p999, max] = latency.percentiles_us().unwrap();
        for (got, exact) in [(p50, 500.0), (p99, 990.0), (p999, 999.0), (max, 1000.0)] {
            assert!((got - exact).abs() <= exact / 1000.0, "{got} for {exact}");
        }
        assert!(
            latency.text().starts_with("one-way us: p50 500.")
                && latency.text().ends_with(" max 1000.00, 1 skewed"),
            "{}",
            latency.text()
        );
        let json: serde_json::Value =
            serde_json::from_str(&format!("{{{}}}", latency.json())).unwrap();
        assert_eq!(json["max_us"].as_f64(), Some(1000.0));
        assert_eq!(json["p999_us"].as_f64(), Some(p999));
        assert_eq!(json["skewed"].as_u64(), Some(1));
        let none: serde_json::Value =
            serde_json::from_str(&format!("{{{}}}", Latency::default().json())).unwrap();
        for key in ["p50_us", "p99_us", "p999_us", "max_us"] {
            assert!(none[key].is_null(), "{key}: {none}");
        }
        assert_eq!(none["skewed"].as_u64(), Some(0));
    }

    #[test]
    fn a_subscriber_keeps_256_receives_posted_unless_told_1_to_8192() {
        let subscribe = |extra: &[&str]| {
            Args::try_parse_from(
                [&["feed", "subscribe", "--group", "239.1.1.1"][..], extra].concat(),
            )
        };
        assert!(matches!(
            subscribe(&[]).unwrap().role,
            Role::Subscribe { receives: 256, .. }
        ));
        assert!(matches!(
            subscribe(&["--receives", "8192"]).unwrap().role,
            Role::Subscribe { receives: 8192, .. }
        ));
        for refused in ["0", "8193"] {
            let err = subscribe(&["--receives", refused]).unwrap_err();
            assert!(err.to_string().contains("must be 1 to 8192"), "{err}");
        }
    }

    #[test]
    fn cm_takes_a_local_address_and_neither_a_device_nor_a_gid() {
        let subscribe = |extra: &[&str]| -> Result<GroupArgs, clap::Error> {
            let args = Args::try_parse_from(
                [&["feed", "subscribe", "--group", "239.1.1.1"][..], extra].concat(),
            )?;
            match args.role {
                Role::Subscribe { group, .. } => Ok(group),
                Role::Publish { group, .. } => Ok(group),
            }
        };
        let group = subscribe(&["--cm", "10.78.0.1"]).unwrap();
        assert_eq!(group.cm, Some(Ipv4Addr::new(10, 78, 0, 1)));
        assert!(check(&group).is_ok());
        assert!(check(&subscribe(&[]).unwrap()).is_ok());
        for refused in ["0.0.0.0", "239.1.1.1", "255.255.255.255", "host", "::1"] {
            let err = subscribe(&["--cm", refused]).unwrap_err();
            assert!(
                err.to_string()
                    .contains("must be an IPv4 address of this host"),
                "{refused}: {err}"
            );
        }
        for other in [&["-d", "rxe0"][..], &["-x", "1"]] {
            let group = subscribe(&[&["--cm", "10.78.0.1"][..], other].concat()).unwrap();
            let refusal = check(&group).unwrap_err().to_string();
            assert!(refusal.starts_with("--cm: "), "{refusal}");
        }
    }

    #[test]
    fn the_size_must_hold_the_number_the_time_and_the_end_marks_count() {
        let publish = |size: &str| {
            Args::try_parse_from(["feed", "publish", "--group", "239.1.1.1", "--size", size])
        };
        let refused = publish("23").unwrap_err();
        assert!(
            refused.to_string().contains("must be 24 to 4096"),
            "{refused}"
        );
        assert!(matches!(
            publish("24").unwrap().role,
            Role::Publish { size: 24, .. }
        ));
    }
}
