//! A market-data style feed over RDMA multicast: a publisher sends
//! numbered datagrams to a group once each, and every subscriber counts
//! what it got, the gaps (UD drops datagrams under loss; a gap is counted
//! and reported, never waited for) and any datagram that came back altered.
//!
//! ```text
//! feed publish --group 239.1.1.1 [--count 1000] [--rate 10000] [--size 64] [-d DEV] [-x GID]
//! feed subscribe --group 239.1.1.1 [--timeout 30] [--count N [--raw]] [--json] [-d DEV] [-x GID]
//! ```
//!
//! A datagram carries its sequence number and a pattern of it; after the
//! last one the publisher sends an end mark, with the count, a few times. A subscriber stops
//! at the end mark (or at `--timeout` seconds without one) and prints one
//! line (or a JSON object): received, gaps, missing, late, altered. It exits
//! non-zero if it received nothing or anything altered.

use std::net::Ipv4Addr;
use std::process::ExitCode;
use std::time::{Duration, Instant};

mod common;

use clap::{Parser, Subcommand};
use rdma_comm_core::verbs::*;

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
        /// Bytes per datagram, 16 to 4096 (and at most the port's MTU).
        #[arg(long, default_value_t = 64, value_parser = common::range(16usize, 4096))]
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
        /// Take the datagrams as they are, without a sequence number or a
        /// pattern (another publisher's, such as rdma-core's `mckey -s`):
        /// count them, and stop after `--count` of them.
        #[arg(long, requires = "count")]
        raw: bool,
        /// Stop after this many datagrams, 1 to 10^12 (default: at the end
        /// mark).
        #[arg(long, value_parser = common::range(1u64, 1_000_000_000_000))]
        count: Option<u64>,
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
}

fn multicast_group(text: &str) -> Result<Ipv4Addr, String> {
    match text.parse::<Ipv4Addr>() {
        Ok(group) if group.is_multicast() => Ok(group),
        _ => Err("must be an IPv4 multicast address (224.0.0.0/4)".into()),
    }
}

/// The sequence number of the end mark.
const END: u64 = u64::MAX;
/// How many times the end mark goes out (UD may drop some).
const END_REPEATS: u32 = 5;
/// Receives kept posted, each the GRH and the largest datagram.
const RECEIVES: usize = 256;
const RECV_LEN: usize = GRH_BYTES + 4096;

fn main() -> ExitCode {
    common::init_logging();
    let args: Args = common::parse("feed");
    let outcome = match args.role {
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
        } => subscribe(&group, Duration::from_secs(timeout), json, raw, count),
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

/// A UD QP on the chosen device, with a CQ of its own.
fn open(
    group: &GroupArgs,
) -> rdma_comm_core::Result<(ProtectionDomain, CompletionQueue, UdQueuePair)> {
    let ctx = Context::open_default(group.device.as_deref())?;
    let pd = ctx.alloc_pd()?;
    let cq = ctx.create_cq(2 * RECEIVES as u32, None)?;
    let config = UdConfig {
        max_recv_wr: RECEIVES as u32,
        gid_index: group.gid_index,
        ..UdConfig::default()
    };
    let qp = pd.create_ud_qp(&cq, &cq, &config)?;
    Ok((pd, cq, qp))
}

/// Datagram `seq`'s bytes: its number, then a pattern of it.
fn fill(datagram: &mut [u8], seq: u64) {
    datagram[..8].copy_from_slice(&seq.to_le_bytes());
    for (i, byte) in datagram[8..].iter_mut().enumerate() {
        *byte = (seq as u8).wrapping_mul(31).wrapping_add(i as u8);
    }
}

fn publish(args: &GroupArgs, count: u64, rate: u64, size: usize) -> rdma_comm_core::Result<bool> {
    let (pd, mut cq, mut qp) = open(args)?;
    if size > qp.max_datagram() as usize {
        eprintln!(
            "feed: --size {size}: larger than the port's MTU ({} B)",
            qp.max_datagram()
        );
        return Ok(false);
    }
    let mut tx = pd.alloc_mr(size, AccessFlags::empty())?;
    let to_group = qp.group_destination(Gid::from_ipv4(args.group))?;
    let interval = Duration::from_secs_f64(1.0 / rate as f64);
    let mut datagram = vec![0; size];
    let started = Instant::now();
    let mut wcs = [WorkCompletion::default(); 4];
    for seq in (0..count).chain(std::iter::repeat_n(END, END_REPEATS as usize)) {
        let due = started + interval.mul_f64(seq.min(count) as f64);
        while Instant::now() < due {
            std::hint::spin_loop();
        }
        fill(&mut datagram, seq);
        if seq == END {
            datagram[8..16].copy_from_slice(&count.to_le_bytes());
        }
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
    /// Datagrams whose bytes were not the pattern of their number.
    altered: u64,
    next: u64,
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

    fn count(&mut self, datagram: &[u8], expected: &mut Vec<u8>) {
        let seq = u64::from_le_bytes(datagram[..8].try_into().unwrap_or_default());
        expected.resize(datagram.len(), 0);
        fill(expected, seq);
        if datagram != expected.as_slice() {
            self.altered += 1;
            return;
        }
        self.received += 1;
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

fn subscribe(
    args: &GroupArgs,
    timeout: Duration,
    json: bool,
    raw: bool,
    count: Option<u64>,
) -> rdma_comm_core::Result<bool> {
    let (pd, mut cq, mut qp) = open(args)?;
    let rx = pd.alloc_mr(RECEIVES * RECV_LEN, AccessFlags::LOCAL_WRITE)?;
    for slot in 0..RECEIVES {
        qp.post_recv(&mut RecvRequest::new(
            slot as u64,
            rx.slice(slot * RECV_LEN, RECV_LEN)?,
        )?)?;
    }
    qp.join(Gid::from_ipv4(args.group))?;
    eprintln!("feed: subscribed to {}", args.group);
    let mut tally = Tally::default();
    let (mut datagram, mut expected) = (vec![0; RECV_LEN], Vec::new());
    let mut wcs = [WorkCompletion::default(); 32];
    let started = Instant::now();
    let mut first: Option<Instant> = None;
    let mut ended = false;
    while !ended && started.elapsed() < timeout {
        for wc in cq.poll(&mut wcs)? {
            wc.ok()?;
            let slot = wc.wr_id() as usize;
            if raw {
                // Any payload counts; its length is the completion's.
                first.get_or_insert_with(Instant::now);
                tally.received += u64::from(datagram_payload(wc).is_some());
            } else if let Some(payload) = datagram_payload(wc).filter(|p| p.len() >= 16) {
                let bytes = &mut datagram[..payload.len()];
                rx.read(slot * RECV_LEN + payload.start, bytes)?;
                if u64::from_le_bytes(bytes[..8].try_into().unwrap_or_default()) == END {
                    // It says how many were published: the last ones may be missing too.
                    let total = u64::from_le_bytes(bytes[8..16].try_into().unwrap_or_default());
                    tally.end(total);
                    ended = true;
                } else {
                    first.get_or_insert_with(Instant::now);
                    tally.count(bytes, &mut expected);
                }
            } else {
                tally.altered += 1;
            }
            qp.post_recv(&mut RecvRequest::new(
                slot as u64,
                rx.slice(slot * RECV_LEN, RECV_LEN)?,
            )?)?;
            if count.is_some_and(|count| tally.received >= count) {
                ended = true;
            }
        }
    }
    let secs = first.map_or(0.0, |first| first.elapsed().as_secs_f64());
    let rate = if secs > 0.0 {
        tally.received as f64 / secs
    } else {
        0.0
    };
    if json {
        println!(
            "{{\"group\":\"{}\",\"received\":{},\"gaps\":{},\"missing\":{},\"late\":{},\"altered\":{},\"ended\":{ended},\"rate\":{rate:.0}}}",
            args.group, tally.received, tally.gaps, tally.missing, tally.late, tally.altered
        );
    } else {
        println!(
            "received {} datagrams from {}: {} gaps ({} missing), {} late, {} altered, {} ({rate:.0}/s)",
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
        );
    }
    Ok(tally.received > 0 && tally.altered == 0)
}
