//! The server: a runtime of pinned reactors, one `Echoer` per peer, and
//! (with `--heap-report-ms`) the heap report the long-lived test reads.

use std::collections::VecDeque;
use std::net::SocketAddr;
use std::sync::{Arc, mpsc};
use std::time::{Duration, Instant};

use rdma_comm_core::Error;
use rdma_comm_core::reactor::*;
use rdma_comm_core::runtime::*;
use rdma_comm_core::session::*;
use rdma_comm_core::verbs::*;

use crate::{Args, MAX_PEERS_AT_ONCE, MAX_WINDOW, matches_pattern, reactor_config};

/// An echo the server could not post yet (no credit or send-queue room);
/// echoes leave in arrival order.
enum Echo {
    /// A SEND, still in its receive slot.
    Send(HeldRecv),
    /// A WRITE_WITH_IMM: write the inbox range back with the same immediate.
    Write { offset: usize, len: usize, imm: u32 },
}

/// The server's side of one peer.
struct Echoer {
    peer: SocketAddr,
    conn: Option<ConnId>,
    inbox: Arc<MemoryRegion>,
    client_inbox: RemoteRegion,
    scratch: Vec<u8>,
    seq: u64,
    waiting: VecDeque<Echo>,
    /// Corrupted data: reported even if the peer then hangs up politely.
    corrupt: Option<String>,
    transport: Option<String>,
    /// The outcome was reported and the session's removal asked for.
    retired: bool,
    /// Last field, so it drops last: the outcome's line is printed once the
    /// reactor removed the session (its QP, control socket and, with the
    /// fields above, its inbox are gone by then).
    report: Report,
}

/// A peer's outcome, printed when dropped.
struct Report {
    line: Option<String>,
    /// Told once the line is printed.
    finished: mpsc::Sender<()>,
}

impl Drop for Report {
    fn drop(&mut self) {
        if let Some(line) = self.line.take() {
            println!("{line}");
            let _ = self.finished.send(());
        }
    }
}

impl Echoer {
    fn drain(&mut self, ctx: &mut Ctx<'_>, conn: ConnId) {
        self.conn = Some(conn);
        while let Some(echo) = self.waiting.pop_front() {
            let result = match echo {
                Echo::Send(held) => match ctx.forward(conn, held, None) {
                    Ok(_) => Ok(()),
                    Err((error, held)) => {
                        self.waiting.push_front(Echo::Send(held));
                        Err(error)
                    }
                },
                Echo::Write { offset, len, imm } => {
                    let staged = match (
                        self.inbox.slice(offset, len),
                        self.client_inbox.slice(offset as u64, len as u64),
                    ) {
                        (Ok(local), Ok(remote)) => ctx.write(conn, &local, remote, Some(imm)),
                        (Err(err), _) | (_, Err(err)) => Err(SendError::Invalid(err)),
                    };
                    staged.map(|_| ()).inspect_err(|_| {
                        self.waiting.push_front(Echo::Write { offset, len, imm });
                    })
                }
            };
            match result {
                Ok(()) => {}
                Err(SendError::WouldBlock) => return,
                Err(err) => {
                    self.transport.get_or_insert_with(|| format!("echo: {err}"));
                    return;
                }
            }
        }
    }

    /// Reports how the peer's session ended and has the reactor remove it
    /// after this pass; the other peers go on.
    fn retire(&mut self, ctx: &mut Ctx<'_>, session: SessionId, outcome: Result<u64, String>) {
        if self.retired {
            return;
        }
        self.retired = true;
        let peer = self.peer;
        self.report.line = Some(match outcome {
            Ok(count) => format!("peer {peer} done: {count} messages verified and echoed"),
            Err(err) => format!("peer {peer} error: {err}"),
        });
        // Printed when the reactor drops this handler with the session.
        ctx.remove_session(session);
    }
}

impl Handler for Echoer {
    fn on_message(&mut self, ctx: &mut Ctx<'_>, conn: ConnId, data: &[u8], imm: Option<u32>) {
        if imm.is_some() || !matches_pattern(data, self.seq) {
            self.corrupt.get_or_insert_with(|| {
                format!(
                    "message {} ({} B SEND) arrived corrupted",
                    self.seq,
                    data.len()
                )
            });
            return;
        }
        self.seq += 1;
        // Zero-copy echo straight from the receive slot.
        if let Some(held) = ctx.hold() {
            self.waiting.push_back(Echo::Send(held));
        }
        self.drain(ctx, conn);
    }

    fn on_write_imm(&mut self, ctx: &mut Ctx<'_>, conn: ConnId, imm: u32, len: u32) {
        let (slot, len) = ((imm >> 24) as usize, len as usize);
        let offset = slot * len;
        let room = self.scratch.len();
        let scratch = &mut self.scratch[..len.min(room)];
        let intact = imm & 0x00ff_ffff == self.seq as u32 & 0x00ff_ffff
            && scratch.len() == len
            && self.inbox.read(offset, scratch).is_ok()
            && matches_pattern(scratch, self.seq);
        if !intact {
            self.corrupt.get_or_insert_with(|| {
                format!(
                    "message {} ({len} B WRITE_WITH_IMM, imm {imm:#x}) arrived corrupted",
                    self.seq
                )
            });
            return;
        }
        self.seq += 1;
        self.waiting.push_back(Echo::Write { offset, len, imm });
        self.drain(ctx, conn);
    }

    fn on_error(&mut self, ctx: &mut Ctx<'_>, conn: ConnId, error: &Error) {
        // The peer stopped acknowledging for the whole retry window (it
        // died, or its link is down): no goodbye explains that, since one
        // comes over the control connection long before the window ends.
        // Report it now rather than when the control connection times out.
        if let (Some(WcStatus::RETRY_EXC_ERR), Some(session)) =
            (error.completion_status(), ctx.session_of(conn))
        {
            // Corrupted data seen before is reported too, as on_peer_gone
            // would have.
            let outcome = match &self.corrupt {
                Some(corrupt) => format!("{corrupt}; then {error}"),
                None => error.to_string(),
            };
            self.retire(ctx, session, Err(outcome));
            return;
        }
        // Kept until the peer watch tells whether the peer left politely
        // (which explains a transport error that followed) or was lost.
        self.transport.get_or_insert_with(|| error.to_string());
    }

    fn on_peer_gone(&mut self, ctx: &mut Ctx<'_>, session: SessionId, status: &PeerStatus) {
        let outcome = match (status, self.corrupt.as_deref()) {
            (_, Some(corrupt)) => Err(corrupt.to_string()),
            // A polite goodbye explains a transport error that followed it.
            (PeerStatus::Disconnected { .. }, None) => Ok(self.seq),
            (PeerStatus::Lost(err), None) => Err(match &self.transport {
                Some(transport) => format!("{err} (after {transport})"),
                None => err.to_string(),
            }),
            (PeerStatus::Alive, None) => return,
        };
        self.retire(ctx, session, outcome);
    }

    fn on_writable(&mut self, ctx: &mut Ctx<'_>, conn: ConnId) {
        if !self.waiting.is_empty() {
            self.drain(ctx, conn);
        }
    }
}

/// Builds each peer's [`Echoer`] on the reactor that serves it.
struct Echoers {
    max_size: usize,
    finished: mpsc::Sender<()>,
}

impl HandlerFactory for Echoers {
    type Handler = Echoer;

    fn build(&self, session: &NewSession<'_>) -> rdma_comm_core::Result<Echoer> {
        let endpoint = session.endpoint;
        let peer = endpoint.peer();
        let protocol = |what: &str| Error::Protocol {
            peer,
            what: what.into(),
        };
        let client_inbox = endpoint
            .remote_region("inbox")
            .ok_or_else(|| protocol("it exported no inbox"))?;
        let inbox = endpoint.exports()[0]
            .memory
            .clone()
            .ok_or_else(|| protocol("its inbox is not readable"))?;
        println!("peer {peer} connected");
        Ok(Echoer {
            peer,
            retired: false,
            conn: None,
            inbox,
            client_inbox,
            scratch: vec![0; self.max_size],
            seq: 0,
            waiting: VecDeque::with_capacity(MAX_WINDOW),
            corrupt: None,
            transport: None,
            report: Report {
                line: None,
                finished: self.finished.clone(),
            },
        })
    }

    fn refused(&self, _reactor: usize, peer: SocketAddr, error: &Error) {
        println!("peer {peer} error: {error}");
        let _ = self.finished.send(());
    }
}

/// Bytes the C allocator counts in use over all its arenas, its own
/// mmapped blocks included: the Rust heap and the verbs provider's
/// allocations alike. Chunks a thread freed into its cache (glibc's
/// tcache) count as in use until they are reused. What the RSS also holds,
/// free pages the allocator keeps below a high-water mark, is not in it.
/// `None` without glibc's `mallinfo2` (glibc before 2.33): it is looked up
/// when asked for, so the program still links and runs there.
#[cfg(all(target_os = "linux", target_env = "gnu"))]
fn heap_in_use() -> Option<usize> {
    type Mallinfo2 = unsafe extern "C" fn() -> libc::mallinfo2;
    // SAFETY: a C string naming a symbol; RTLD_DEFAULT searches the
    // libraries already loaded, and a missing symbol is a null pointer.
    let symbol = unsafe { libc::dlsym(libc::RTLD_DEFAULT, c"mallinfo2".as_ptr()) };
    if symbol.is_null() {
        return None;
    }
    // SAFETY: glibc's `mallinfo2` has this signature (malloc.h): no
    // arguments, a struct of `size_t`s returned by value.
    let mallinfo2: Mallinfo2 = unsafe { std::mem::transmute(symbol) };
    // SAFETY: it reads the allocator's counters under each arena's lock;
    // its MT-Unsafe notes (initialisation, `mallopt`) do not apply once
    // the program has allocated, and nothing here calls `mallopt`.
    let info = unsafe { mallinfo2() };
    Some(info.uordblks + info.hblkhd)
}

#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
fn heap_in_use() -> Option<usize> {
    None
}

pub(crate) fn serve(args: &Args) -> rdma_comm_core::Result<bool> {
    let ctx = Context::open_default(args.dev.device.as_deref())?;
    let pd = ctx.alloc_pd()?;
    let max_size = args.max_size;
    // A full client window plus the credits the reactor keeps in reserve.
    let depth = MAX_WINDOW as u32 + 8;
    let (finished, outcomes) = mpsc::channel();
    let config = RuntimeConfig {
        reactors: args.runtime.reactors.into(),
        cores: args.runtime.core_choice(false)?,
        reactor: reactor_config(args, max_size, depth, 1, MAX_PEERS_AT_ONCE),
        policy: PlacementPolicy::FewestSessions,
        ..RuntimeConfig::default()
    };
    let factory = Echoers {
        max_size,
        finished: finished.clone(),
    };
    let mut runtime = Runtime::start(&pd, config, factory)?;
    println!("runtime: {}", runtime.plan());
    let mut config = runtime.server_config(AccessFlags::REMOTE_WRITE);
    args.dev.apply(&mut config.qp);
    config.max_peers = args.peers;
    config.handshake_timeout = Duration::from_millis(args.handshake_timeout_ms);
    args.auth.secure(&mut config)?;
    config.transport = args.transport.transport();
    config.exports = Some(Arc::new(move |_peer: SocketAddr, pd: &ProtectionDomain| {
        // Each peer writes into its own inbox, through a window bound to its
        // own QP: no peer can touch another's inbox, even knowing its key.
        Ok(vec![Export::shared(
            1,
            "inbox",
            Arc::new(pd.alloc_mr(max_size, AccessFlags::LOCAL_WRITE | AccessFlags::MW_BIND)?),
            AccessFlags::REMOTE_WRITE,
        )])
    }));
    // On stdout, one line each, as tests and scripts read them; escaped,
    // as `common::report_refusals` does, since the reason may quote what a
    // stranger sent.
    config.on_failure = Some(Arc::new(|failure: &HandshakeFailure| {
        println!("rejected {}: {:?}", failure.peer, failure.error.to_string());
    }));
    let addr = runtime.serve(args.listen.as_str(), config)?;
    println!("listening on {addr}");
    // Every peer ends with one outcome (done, error, or refused by its
    // reactor); the reactors report them. Waiting here costs nothing.
    drop(finished);
    let mut served = 0;
    let report_every = args.heap_report_ms.map(Duration::from_millis);
    let mut next_report = Instant::now();
    while args.peers.is_none_or(|max| served < max) {
        let Some(every) = report_every else {
            if outcomes.recv().is_err() {
                break;
            }
            served += 1;
            continue;
        };
        if Instant::now() >= next_report {
            match heap_in_use() {
                Some(bytes) => println!("heap: {bytes} B in use"),
                None => println!("heap: unknown (no glibc mallinfo2)"),
            }
            next_report = Instant::now() + every;
        }
        match outcomes.recv_timeout(next_report.saturating_duration_since(Instant::now())) {
            Ok(_) => served += 1,
            Err(mpsc::RecvTimeoutError::Timeout) => {}
            Err(mpsc::RecvTimeoutError::Disconnected) => break,
        }
    }
    // Let handshakes still in progress end on their own (each by its
    // timeout), so their failures are reported rather than cut short.
    while runtime.pending_handshakes() > 0 {
        std::thread::sleep(Duration::from_millis(50));
    }
    runtime.stop();
    for reactor in runtime.join()? {
        println!("{reactor}");
    }
    Ok(true)
}
