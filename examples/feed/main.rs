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

use std::net::Ipv4Addr;
use std::process::ExitCode;
use std::time::Duration;

mod cm;
#[path = "../common/mod.rs"]
mod common;
mod format;
mod reactor;
#[path = "../common/rtt.rs"]
mod rtt;

use clap::{Parser, Subcommand};

use cm::{publish, subscribe};
use format::{MIN_SIZE, Sink};
use reactor::{publish_from_reactor, subscribe_on_reactor};

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

/// Receives kept posted by default, each the GRH and the largest datagram.
const RECEIVES: usize = 256;

/// The most `--receives` takes: its CQ (twice as deep) stays within what
/// Soft-RoCE allows (32767 entries), and its buffers within 34 MiB.
const MAX_RECEIVES: usize = 8192;

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
        } => match group.cm {
            None => publish_from_reactor(&group, count, rate, size),
            Some(_) => publish(&group, count, rate, size),
        },
        Role::Subscribe {
            group,
            timeout,
            json,
            raw,
            count,
            receives,
        } => {
            let (timeout, sink) = (Duration::from_secs(timeout), Sink::new(raw, count));
            match group.cm {
                None => subscribe_on_reactor(&group, timeout, sink, receives),
                Some(_) => subscribe(&group, timeout, sink, receives),
            }
            .map(|sink| sink.report(&group, json))
        }
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

#[cfg(test)]
mod tests {
    use super::*;

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
