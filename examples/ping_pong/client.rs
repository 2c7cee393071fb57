//! The client: keeps a window of pings in flight over one session and
//! checks every echo byte by byte.

use std::sync::Arc;
use std::time::Instant;

use rdma_comm_core::Error;
use rdma_comm_core::reactor::*;
use rdma_comm_core::session::*;
use rdma_comm_core::verbs::*;
use rdma_perf::Clock;

use crate::rtt::RttRecorder;
use crate::{
    Args, Op, PEER_CHECK_INTERVAL, ROUND_TRIP_DEADLINE, matches_pattern, pattern, reactor_config,
    write_imm,
};

/// The client: keeps `window` pings in flight and checks every echo.
struct Pinger {
    iters: u64,
    size: usize,
    op: Op,
    window: usize,
    conn: Option<ConnId>,
    source: MemoryRegion,
    inbox: Arc<MemoryRegion>,
    server_inbox: RemoteRegion,
    clock: Clock,
    scratch: Vec<u8>,
    /// Staging time of each in-flight ping, by window slot.
    sent_at: Vec<u64>,
    next: u64,
    answered: u64,
    rtts: RttRecorder,
    mismatches: u64,
    failure: Option<String>,
    /// The failure is a transport error of the connection (it names the
    /// QP and the server), not a protocol one.
    typed_failure: bool,
}

impl Pinger {
    fn uses_send(&self, seq: u64) -> bool {
        match self.op {
            Op::Send => true,
            Op::WriteImm => false,
            Op::Both => seq.is_multiple_of(2),
        }
    }

    fn pump(&mut self, ctx: &mut Ctx<'_>) {
        let Some(conn) = self.conn else { return };
        while self.next < self.iters && self.next - self.answered < self.window as u64 {
            let seq = self.next;
            let slot = (seq % self.window as u64) as usize;
            let size = self.size;
            let staged = if self.uses_send(seq) {
                ctx.send_with(conn, size, None, |buf| {
                    for (dst, src) in buf.iter_mut().zip(pattern(seq, size)) {
                        *dst = src;
                    }
                })
            } else {
                let offset = slot * size;
                for (dst, src) in self.scratch.iter_mut().zip(pattern(seq, size)) {
                    *dst = src;
                }
                // This slot's previous ping was answered, so nothing reads it.
                let local = self
                    .source
                    .write(offset, &self.scratch)
                    .and_then(|()| self.source.slice(offset, size));
                let remote = self.server_inbox.slice(offset as u64, size as u64);
                match (local, remote) {
                    (Ok(local), Ok(remote)) => {
                        ctx.write(conn, &local, remote, Some(write_imm(slot, seq)))
                    }
                    (Err(err), _) | (_, Err(err)) => Err(SendError::Invalid(err)),
                }
            };
            match staged {
                Ok(_) => {
                    self.sent_at[slot] = self.clock.now();
                    self.next += 1;
                }
                Err(SendError::WouldBlock) => return,
                Err(err) => {
                    self.failure = Some(format!("ping {seq}: {err}"));
                    return;
                }
            }
        }
    }

    fn answer(&mut self, ctx: &mut Ctx<'_>, ok: bool, what: impl FnOnce() -> String) {
        let seq = self.answered;
        let slot = (seq % self.window as u64) as usize;
        self.rtts
            .record(self.clock.nanos(self.sent_at[slot], self.clock.now()));
        if !ok {
            self.mismatches += 1;
            eprintln!("message {seq}: echo did not match ({})", what());
        }
        self.answered += 1;
        self.pump(ctx);
    }

    fn done(&self) -> bool {
        self.answered == self.iters || self.failure.is_some()
    }
}

impl Handler for Pinger {
    fn on_established(&mut self, ctx: &mut Ctx<'_>, conn: ConnId) {
        self.conn = Some(conn);
        self.pump(ctx);
    }

    fn on_message(&mut self, ctx: &mut Ctx<'_>, _conn: ConnId, data: &[u8], imm: Option<u32>) {
        let seq = self.answered;
        let ok = self.uses_send(seq)
            && imm.is_none()
            && data.len() == self.size
            && matches_pattern(data, seq);
        self.answer(ctx, ok, || format!("SEND echo, {} bytes", data.len()));
    }

    fn on_write_imm(&mut self, ctx: &mut Ctx<'_>, _conn: ConnId, imm: u32, len: u32) {
        let seq = self.answered;
        let slot = (seq % self.window as u64) as usize;
        let expected_kind = !self.uses_send(seq);
        let scratch = &mut self.scratch[..(len as usize).min(self.size)];
        let ok = expected_kind
            && imm == write_imm(slot, seq)
            && len as usize == self.size
            && self.inbox.read(slot * self.size, scratch).is_ok()
            && matches_pattern(scratch, seq);
        self.answer(ctx, ok, || {
            format!("WRITE_WITH_IMM echo, imm {imm:#x}, {len} bytes")
        });
    }

    fn on_peer_gone(&mut self, _ctx: &mut Ctx<'_>, _session: SessionId, status: &PeerStatus) {
        self.failure.get_or_insert_with(|| match status {
            PeerStatus::Disconnected { code } => format!("the server hung up (code {code})"),
            PeerStatus::Lost(err) => err.to_string(),
            PeerStatus::Alive => "the server's link reported nothing".into(),
        });
    }

    fn on_error(&mut self, _ctx: &mut Ctx<'_>, _conn: ConnId, error: &Error) {
        // A typed error names the QP and the server already. Only the
        // first failure counts: a later error does not retype an earlier
        // protocol failure (nor the other way round).
        if self.failure.is_none() {
            self.typed_failure = true;
            self.failure = Some(error.to_string());
        }
    }

    fn on_writable(&mut self, ctx: &mut Ctx<'_>, _conn: ConnId) {
        self.pump(ctx);
    }
}

pub(crate) fn ping(args: &Args) -> rdma_comm_core::Result<bool> {
    let addr = args.connect.as_deref().unwrap_or_default();
    let ctx = Context::open_default(args.dev.device.as_deref())?;
    let pd = ctx.alloc_pd()?;
    // Both checked before the device was opened (main's `check`).
    let size = args.size;
    let window = args.reactor.batch_or(1);
    let inbox = Arc::new(pd.alloc_mr(
        window * size,
        AccessFlags::LOCAL_WRITE | AccessFlags::MW_BIND,
    )?);
    let source = pd.alloc_mr(window * size, AccessFlags::empty())?;
    let depth = (2 * window as u32).max(16);
    let mut reactor: Reactor<Pinger> =
        Reactor::new(&pd, reactor_config(args, size, depth, depth, 1))?;
    let mut spec = reactor.qp_spec_with_access("ping", AccessFlags::REMOTE_WRITE);
    args.dev.apply(&mut spec.qp);
    let config = ClientConfig::new(vec![spec])
        .with_exports(vec![Export::new(
            1,
            "inbox",
            inbox.as_ref(),
            AccessFlags::REMOTE_WRITE,
        )])
        .with_auth_key(args.auth.key()?)
        .with_transport(args.transport.transport());
    let endpoint = ClientSession::connect(addr, &pd, &config)?;
    let peer = endpoint.peer();
    let server_inbox = endpoint
        .remote_region("inbox")
        .ok_or_else(|| Error::Protocol {
            peer,
            what: "server exported no \"inbox\" region".into(),
        })?;
    if (window * size) as u64 > server_inbox.len() {
        return Err(Error::Protocol {
            peer,
            what: format!(
                "{window} pings of {size} B need {} B, the server takes {} B per peer (its --max-size)",
                window * size,
                server_inbox.len()
            ),
        });
    }
    println!(
        "connected to {peer}: {} x {size} B, op {:?}, {window} in flight",
        args.iters, args.op
    );
    let pinger = Pinger {
        iters: args.iters,
        size,
        op: args.op,
        window,
        conn: None,
        source,
        inbox,
        server_inbox,
        clock: Clock::new(),
        scratch: vec![0; size],
        sent_at: vec![0; window],
        next: 0,
        answered: 0,
        rtts: RttRecorder::new(),
        mismatches: 0,
        failure: None,
        typed_failure: false,
    };
    let session = reactor.add(endpoint, pinger)?;

    let mut last_progress = (0, Instant::now());
    // Reading the clock every pass would cost more than the pass (a syscall
    // on a VM's HPET): the timer reads it now and then. The reactor watches
    // the server itself (Pinger::on_peer_gone).
    let mut progress_check = reactor.pass_timer(PEER_CHECK_INTERVAL);
    loop {
        let completions = reactor.turn()?;
        let Some(pinger) = reactor.handler(session) else {
            break;
        };
        if pinger.done() {
            break;
        }
        if !progress_check.expired_after(completions) {
            continue;
        }
        if pinger.answered != last_progress.0 {
            last_progress = (pinger.answered, Instant::now());
        } else if last_progress.1.elapsed() > ROUND_TRIP_DEADLINE {
            return Err(Error::Protocol {
                peer,
                what: format!(
                    "no answer to message {} within {ROUND_TRIP_DEADLINE:?}",
                    pinger.answered
                ),
            });
        }
    }
    let (mut link, pinger) = reactor
        .remove(session)
        .ok_or(Error::InvalidArgument("the session vanished"))?;
    // The reactor destroyed the QPs; say goodbye on the control connection.
    link.close();
    if let Some(failure) = &pinger.failure {
        if pinger.typed_failure {
            eprintln!("ping_pong: {failure}");
            return Ok(false);
        }
        return Err(Error::Protocol {
            peer,
            what: failure.clone(),
        });
    }
    print_summary(&pinger.rtts, pinger.mismatches);
    Ok(pinger.mismatches == 0 && pinger.rtts.count() == args.iters)
}

/// The RTT line: min and max exact, median and p99 within 0.1 %.
fn print_summary(rtts: &RttRecorder, mismatches: u64) {
    println!(
        "{} round trips, {mismatches} mismatches; RTT usec: min {:.2} median {:.2} p99 {:.2} max {:.2}",
        rtts.count(),
        rtts.quantile_us(0.0),
        rtts.quantile_us(0.5),
        rtts.quantile_us(0.99),
        rtts.quantile_us(1.0)
    );
}
