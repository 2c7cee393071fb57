//! The default: each side a datagram endpoint of a reactor, the
//! publisher paced from `on_idle`, the subscriber counting in
//! `on_datagram`.

use std::time::{Duration, Instant};

use rdma_comm_core::reactor::{
    ConnId, Ctx, DatagramId, DatagramSource, Handler, Idle, Reactor, ReactorConfig, SendError,
};
use rdma_comm_core::verbs::*;

use crate::GroupArgs;
use crate::format::{END, MIN_SIZE, PATTERN_AT, Sink, fill, realtime_ns, stamp};

/// How many times the end mark goes out (UD may drop some).
pub(crate) const END_REPEATS: u32 = 5;

/// How long a publisher's reactor keeps running after its last datagram
/// was staged, so the send queue empties before the QP is destroyed.
pub(crate) const LINGER: Duration = Duration::from_millis(100);

/// Time between the end marks.
pub(crate) const END_SPACING: Duration = Duration::from_millis(2);

/// A feed's side on a reactor's datagram endpoint.
pub(crate) enum FeedHandler {
    Publisher(Publisher),
    Subscriber(Sink),
}

/// Sends `count` datagrams to the group at `rate`, then the end mark.
pub(crate) struct Publisher {
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

    fn on_idle(&mut self, ctx: &mut Ctx<'_>) -> Idle {
        let Self::Publisher(publisher) = self else {
            return Idle::Done;
        };
        let (dgram, to) = (publisher.dgram, &publisher.to);
        let started = *publisher.started.get_or_insert_with(Instant::now);
        while !publisher.is_done() {
            if Instant::now() < publisher.due(started) {
                return Idle::Again;
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
                Err(SendError::WouldBlock) => return Idle::Again,
                Err(err) => {
                    eprintln!("feed: a datagram was refused: {err}");
                    publisher.stopped = true;
                    ctx.stop();
                    return Idle::Done;
                }
            }
        }
        // Once: the run that lingers after this one keeps the reactor going.
        if !publisher.stopped {
            publisher.stopped = true;
            ctx.stop();
        }
        Idle::Done
    }
}

/// A reactor with one datagram endpoint of `receives` receives for `handler`.
pub(crate) fn feed_reactor(
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

pub(crate) fn publish_from_reactor(
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

pub(crate) fn subscribe_on_reactor(
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
