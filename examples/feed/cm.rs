//! `--cm`: each side a UD QP of the connection manager's id, joined to
//! the group with `rdma_join_multicast` (as rdma-core's `mckey` does),
//! polled here.

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::time::{Duration, Instant};

use rdma_comm_core::verbs::cm::{CmEventKind, CmId, EventChannel};
use rdma_comm_core::verbs::*;

use crate::format::{END, MIN_SIZE, PATTERN_AT, Sink, fill, realtime_ns, stamp};
use crate::reactor::END_REPEATS;
use crate::{GroupArgs, RECEIVES};

/// How long the connection manager may take to resolve the group's
/// address from the local one (mckey's 2 s).
pub(crate) const RESOLVE_TIMEOUT: Duration = Duration::from_secs(2);

/// How long to wait for the connection manager's answer to a resolve or a
/// join.
pub(crate) const CM_WAIT: Duration = Duration::from_secs(10);

pub(crate) const RECV_LEN: usize = GRH_BYTES + 4096;

/// A member of the group: a UD QP with a CQ of its own, and with
/// `--cm` the connection manager's id it was created on.
pub(crate) struct Member {
    qp: UdQueuePair,
    cq: CompletionQueue,
    pd: ProtectionDomain,
    cm: Option<Cm>,
}

/// The connection manager's id of a `--cm` member, and its channel.
pub(crate) struct Cm {
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
pub(crate) fn open(group: &GroupArgs, receives: usize) -> rdma_comm_core::Result<Member> {
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

pub(crate) fn publish(
    args: &GroupArgs,
    count: u64,
    rate: u64,
    size: usize,
) -> rdma_comm_core::Result<bool> {
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

/// `--cm`'s subscriber: a UD QP of the connection manager's id, polled here
/// into `sink` until it has seen the end or `timeout` passes.
pub(crate) fn subscribe(
    args: &GroupArgs,
    timeout: Duration,
    mut sink: Sink,
    receives: usize,
) -> rdma_comm_core::Result<Sink> {
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
    Ok(sink)
}
