//! Type-2 memory windows (a peer can reach only the memory
//! exported to it). Every QP and region here shares one protection domain,
//! as a server's do; the memory is registered for windows only
//! (`LOCAL_WRITE | MW_BIND`, no `REMOTE_*`), and a window bound on the QP
//! that serves peer A grants A, and only A, access to it.
//!
//! Gated with `verbs_test!` (see `tests/util/mod.rs`): they run in the
//! Soft-RoCE guest (`tools/test`), one rxe0 for every QP.

mod util;

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use rdma_comm_core::Error;
use rdma_comm_core::reactor::*;
use rdma_comm_core::session::CqChoice;
use rdma_comm_core::verbs::*;
use util::reactor::BoxedHandler;
use util::*;

/// Rights a window grants in these tests.
const RW: AccessFlags = AccessFlags::REMOTE_WRITE.union(AccessFlags::REMOTE_READ);
/// Memory for windows only: no peer reaches it with the MR's own key.
const WINDOWS_ONLY: AccessFlags = AccessFlags::LOCAL_WRITE.union(AccessFlags::MW_BIND);

/// A local QP that serves one peer, and that peer's QP, connected, each on
/// its own CQ. The local QP accepts remote WRITE and READ (the windows
/// decide what the peer actually reaches).
struct Link {
    local: QueuePair,
    local_cq: CompletionQueue,
    peer: QueuePair,
    peer_cq: CompletionQueue,
}

impl Link {
    #[track_caller]
    fn new(ctx: &Context, pd: &ProtectionDomain) -> Self {
        let local_cq = ctx.create_cq(64, None).expect("create_cq");
        let peer_cq = ctx.create_cq(64, None).expect("create_cq");
        let mut local = pd
            .create_qp(&local_cq, &local_cq, &remote_config())
            .expect("create_qp");
        let mut peer = pd
            .create_qp(&peer_cq, &peer_cq, &QpConfig::default())
            .expect("create_qp");
        let (l, p) = (local.endpoint(), peer.endpoint());
        local.connect(&p).expect("connect local");
        peer.connect(&l).expect("connect peer");
        Link {
            local,
            local_cq,
            peer,
            peer_cq,
        }
    }

    /// The peer WRITEs `len` bytes at `offset` of `src` to `target`, and
    /// waits for the completion.
    #[track_caller]
    fn write(&mut self, src: &MemoryRegion, offset: usize, target: RemoteSlice) -> WorkCompletion {
        let local = src.slice(offset, target.len() as usize).unwrap();
        let mut wr = WorkRequest::write(1, local, target).unwrap().signaled();
        self.peer.post_send(&mut wr).expect("post WRITE");
        wait_for(&mut self.peer_cq, 1)[0]
    }

    /// The peer READs `source` into `dst` at `offset`, and waits for the
    /// completion.
    #[track_caller]
    fn read(&mut self, dst: &MemoryRegion, offset: usize, source: RemoteSlice) -> WorkCompletion {
        let local = dst.slice(offset, source.len() as usize).unwrap();
        let mut wr = WorkRequest::read(2, local, source).unwrap().signaled();
        self.peer.post_send(&mut wr).expect("post READ");
        wait_for(&mut self.peer_cq, 1)[0]
    }
}

#[track_caller]
fn assert_ok(wc: WorkCompletion, what: &str) {
    if let Err(err) = wc.ok() {
        panic!("{what}: {err}");
    }
}

#[track_caller]
fn assert_refused(wc: WorkCompletion, what: &str) {
    assert_eq!(
        wc.status(),
        WcStatus::REM_ACCESS_ERR,
        "{what}: expected a remote access error, got {wc:?}"
    );
}

verbs_test! {
    fn a_window_serves_only_the_peer_it_is_bound_for() {
        let ctx = open_device();
        let pd = ctx.alloc_pd().unwrap();
        let mut a = Link::new(&ctx, &pd);
        let mut b = Link::new(&ctx, &pd);
        let mut b_reader = Link::new(&ctx, &pd);
        let region = pd.alloc_mr(4096, WINDOWS_ONLY).unwrap();
        let window = a
            .local
            .bind_window(pd.alloc_mw().unwrap(), region.registration(), RW, SendFlags::SIGNALED)
            .expect("bind");
        let wc = wait_ok(&mut a.local_cq);
        assert_eq!((wc.wr_id(), wc.opcode()), (BIND_WR_ID, WcOpcode::BIND_MW));
        assert_eq!(a.local.bound_windows(), 1);
        assert!(!a.local.has_posted(), "a bind is not a post a reactor must refuse");
        let desc = window.remote();
        // Zero-based: the peer addresses offsets, and never learns where
        // the memory is.
        assert_eq!((desc.addr(), desc.len()), (0, 4096));
        assert_eq!((window.qpn(), window.access()), (a.local.qpn(), RW));
        assert_ne!(desc.rkey(), region.registration().mr_rkey());
        assert!(window.registration().same_as(region.registration()));

        let mut src = pd.alloc_mr(4096, AccessFlags::LOCAL_WRITE).unwrap();
        let dst = pd.alloc_mr(4096, AccessFlags::LOCAL_WRITE).unwrap();
        src.write(0, &pattern(1, 256)).unwrap();
        assert_ok(a.write(&src, 0, desc.slice(0, 256).unwrap()), "A's WRITE");
        assert_eq!(read_back(&region, 0, 256), pattern(1, 256));
        assert_ok(a.read(&dst, 0, desc.slice(0, 256).unwrap()), "A's READ");
        assert_eq!(read_back(&dst, 0, 256), pattern(1, 256));

        // B holds exactly A's descriptor, and its QP is in the same PD.
        let stolen = RemoteRegion::new(desc.addr(), desc.len(), desc.rkey());
        src.write(256, &pattern(2, 256)).unwrap();
        assert_refused(b.write(&src, 256, stolen.slice(0, 256).unwrap()), "B's WRITE");
        assert_eq!(read_back(&region, 0, 256), pattern(1, 256), "B wrote nothing");
        assert_refused(
            b_reader.read(&dst, 256, stolen.slice(0, 256).unwrap()),
            "B's READ",
        );
        assert_eq!(read_back(&dst, 256, 256), vec![0; 256], "B read nothing");

        // A's connection is untouched.
        src.write(512, &pattern(3, 256)).unwrap();
        assert_ok(a.write(&src, 512, desc.slice(256, 256).unwrap()), "A's WRITE after B's");
        assert_eq!(read_back(&region, 256, 256), pattern(3, 256));
        assert_ok(a.read(&dst, 512, desc.slice(0, 512).unwrap()), "A's READ after B's");
        let mut expected = pattern(1, 256);
        expected.extend(pattern(3, 256));
        assert_eq!(read_back(&dst, 512, 512), expected);
    }
}

verbs_test! {
    fn dropping_the_window_revokes_the_peers_access() {
        let ctx = open_device();
        let pd = ctx.alloc_pd().unwrap();
        let mut a = Link::new(&ctx, &pd);
        let region = pd.alloc_mr(4096, WINDOWS_ONLY).unwrap();
        // Unsignaled: A's first access works once the bind has run (here:
        // the bind runs before A's WRITE completes, as rxe runs it right away).
        let window = a
            .local
            .bind_window(pd.alloc_mw().unwrap(), region.registration(), RW, SendFlags::empty())
            .expect("bind");
        let desc = window.remote();
        let mut src = pd.alloc_mr(4096, AccessFlags::LOCAL_WRITE).unwrap();
        src.write(0, &pattern(4, 128)).unwrap();
        assert_ok(a.write(&src, 0, desc.slice(0, 128).unwrap()), "A's WRITE");
        assert_eq!(read_back(&region, 0, 128), pattern(4, 128));

        drop(window); // the peer is gone
        assert!(
            a.local_cq.poll(&mut [WorkCompletion::default(); 4]).unwrap().is_empty(),
            "an unsignaled bind that worked reports nothing"
        );
        src.write(0, &pattern(5, 128)).unwrap();
        assert_refused(a.write(&src, 0, desc.slice(0, 128).unwrap()), "A's WRITE after the drop");
        assert_eq!(read_back(&region, 0, 128), pattern(4, 128), "nothing written after the drop");
    }
}

verbs_test! {
    fn memory_for_windows_is_out_of_reach_of_its_own_rkey() {
        let ctx = open_device();
        let pd = ctx.alloc_pd().unwrap();
        let mut a = Link::new(&ctx, &pd);
        let region = pd.alloc_mr(4096, WINDOWS_ONLY).unwrap();
        assert!(region.remote().is_err(), "memory without REMOTE_* rights cannot be exported");
        // A window on it makes no difference to the MR's own key.
        let _window = a
            .local
            .bind_window(pd.alloc_mw().unwrap(), region.registration(), RW, SendFlags::SIGNALED)
            .expect("bind");
        wait_ok(&mut a.local_cq);
        let own = RemoteRegion::new(region.addr(), 4096, region.registration().mr_rkey());
        let mut src = pd.alloc_mr(4096, AccessFlags::LOCAL_WRITE).unwrap();
        src.write(0, &pattern(6, 64)).unwrap();
        // The local QP grants REMOTE_WRITE and READ: only the MR refuses.
        assert_refused(a.write(&src, 0, own.slice(0, 64).unwrap()), "WRITE with the MR's rkey");
        assert_eq!(read_back(&region, 0, 64), vec![0; 64]);
        let mut b = Link::new(&ctx, &pd);
        let dst = pd.alloc_mr(4096, AccessFlags::LOCAL_WRITE).unwrap();
        assert_refused(b.read(&dst, 0, own.slice(0, 64).unwrap()), "READ with the MR's rkey");
    }
}

/// Counts the errors the library logs when tearing down an MR or a window
/// (a deregistration refused because a window is still bound, say).
struct TeardownErrors(AtomicUsize);

impl log::Log for TeardownErrors {
    fn enabled(&self, metadata: &log::Metadata<'_>) -> bool {
        metadata.level() <= log::Level::Error
    }

    fn log(&self, record: &log::Record<'_>) {
        let text = record.args().to_string();
        if text.contains("ibv_dereg_mr") || text.contains("ibv_dealloc_mw") {
            self.0.fetch_add(1, Ordering::Relaxed);
        }
        eprintln!("{}: {text}", record.level());
    }

    fn flush(&self) {}
}

static TEARDOWN_ERRORS: TeardownErrors = TeardownErrors(AtomicUsize::new(0));

fn teardown_errors() -> usize {
    // The first test to ask installs the logger; it stays for the binary.
    if log::set_logger(&TEARDOWN_ERRORS).is_ok() {
        log::set_max_level(log::LevelFilter::Error);
    }
    TEARDOWN_ERRORS.0.load(Ordering::Relaxed)
}

verbs_test! {
    fn a_bound_window_keeps_its_memory_registered_and_goes_with_its_qp() {
        let before = teardown_errors();
        let ctx = open_device();
        let pd = ctx.alloc_pd().unwrap();
        let mut a = Link::new(&ctx, &pd);
        let mut region = pd.alloc_mr(4096, WINDOWS_ONLY).unwrap();
        region.write(0, &pattern(7, 256)).unwrap();
        let window = a
            .local
            .bind_window(pd.alloc_mw().unwrap(), region.registration(), RW, SendFlags::SIGNALED)
            .expect("bind");
        wait_ok(&mut a.local_cq);
        let desc = window.remote();
        // The region's handle goes while the peer may still use the window:
        // the window keeps the memory registered (rxe would refuse to
        // deregister an MR with a window bound to it, and the buffer would
        // leak), and the peer still reaches it.
        drop(region);
        assert_eq!(teardown_errors(), before, "nothing was deregistered under the window");
        let dst = pd.alloc_mr(4096, AccessFlags::LOCAL_WRITE).unwrap();
        assert_ok(a.read(&dst, 0, desc.slice(0, 256).unwrap()), "A's READ");
        assert_eq!(read_back(&dst, 0, 256), pattern(7, 256));
        // The QP goes first: it deallocates the window before it is
        // destroyed (rxe's destroy would block for about 50 s with a window
        // still bound), then the memory goes with the window's handle.
        let Link { local, .. } = a;
        let start = Instant::now();
        drop(local);
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "destroying the QP took {:?}: was a window still bound to it?",
            start.elapsed()
        );
        assert!(window.is_revoked(), "the QP took its window with it");
        drop(window);
        assert_eq!(teardown_errors(), before, "window and memory went without an error");
    }
}

verbs_test! {
    fn binds_that_cannot_work_are_refused_before_posting() {
        let ctx = open_device();
        let attr = ctx.query_device().unwrap();
        assert!(attr.mem_window_type2 && attr.max_mw > 0, "rxe has type-2 windows: {attr:?}");
        let pd = ctx.alloc_pd().unwrap();
        let other_pd = ctx.alloc_pd().unwrap();
        let mut a = Link::new(&ctx, &pd);
        let region = pd.alloc_mr(4096, WINDOWS_ONLY).unwrap();
        let refused = |qp: &mut QueuePair,
                           window: MemoryWindow,
                           region: &Registration,
                           access: AccessFlags,
                           flags: SendFlags,
                           what: &str| {
            match qp.bind_window(window, region, access, flags) {
                Err(Error::InvalidArgument(why)) => eprintln!("{what}: {why}"),
                other => panic!("{what}: expected InvalidArgument, got {other:?}"),
            }
        };
        let plain = pd.alloc_mr(4096, AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE).unwrap();
        refused(&mut a.local, pd.alloc_mw().unwrap(), plain.registration(), RW, SendFlags::empty(), "memory without MW_BIND");
        refused(&mut a.local, pd.alloc_mw().unwrap(), region.registration(), AccessFlags::empty(), SendFlags::empty(), "no rights");
        refused(&mut a.local, pd.alloc_mw().unwrap(), region.registration(), AccessFlags::MW_BIND, SendFlags::empty(), "MW_BIND as a right");
        refused(&mut a.local, pd.alloc_mw().unwrap(), region.registration(), RW, SendFlags::INLINE, "an inline bind");
        refused(&mut a.local, other_pd.alloc_mw().unwrap(), region.registration(), RW, SendFlags::empty(), "a window of another PD");
        let foreign = other_pd.alloc_mr(4096, WINDOWS_ONLY).unwrap();
        refused(&mut a.local, pd.alloc_mw().unwrap(), foreign.registration(), RW, SendFlags::empty(), "memory of another PD");
        let bind_only = pd.alloc_mr(4096, AccessFlags::MW_BIND).unwrap();
        refused(&mut a.local, pd.alloc_mw().unwrap(), bind_only.registration(), AccessFlags::REMOTE_WRITE, SendFlags::empty(), "REMOTE_WRITE without LOCAL_WRITE");
        let cq = ctx.create_cq(16, None).unwrap();
        let mut unconnected = pd.create_qp(&cq, &cq, &remote_config()).unwrap();
        refused(&mut unconnected, pd.alloc_mw().unwrap(), region.registration(), RW, SendFlags::empty(), "a QP in INIT");
        assert_eq!((a.local.bound_windows(), a.local.has_posted()), (0, false), "nothing was posted");

        // A READ-only window on memory without LOCAL_WRITE is fine, and
        // grants no WRITE.
        let window = a
            .local
            .bind_window(pd.alloc_mw().unwrap(), bind_only.registration(), AccessFlags::REMOTE_READ, SendFlags::SIGNALED)
            .expect("a READ-only window");
        wait_ok(&mut a.local_cq);
        let dst = pd.alloc_mr(4096, AccessFlags::LOCAL_WRITE).unwrap();
        assert_ok(a.read(&dst, 0, window.remote().slice(0, 64).unwrap()), "READ");
        assert_refused(a.write(&dst, 0, window.remote().slice(0, 64).unwrap()), "WRITE through a READ-only window");
    }
}

// ---------------------------------------------------------------------------
// The reactor takes a QP with windows bound on it.

const ROUNDS: u64 = 64;
const MSG: usize = 64;

fn small_reactor_config() -> ReactorConfig {
    ReactorConfig {
        slot_size: 256,
        recv_depth: 16,
        send_slots: 16,
        signal_interval: 4,
        sq_depth: 32,
        ..Default::default()
    }
}

/// A QP on `reactor`'s CQ with `max_send_wr` = the reactor's depth + `extra`.
fn reactor_qp(
    reactor: &mut Reactor<BoxedHandler, ()>,
    pd: &ProtectionDomain,
    max_send_wr: u32,
    remote_access: AccessFlags,
) -> QueuePair {
    let spec = reactor.qp_spec("windows");
    let CqChoice::Shared(cq) = spec.cq else {
        panic!("a reactor's QP spec names its shared CQ");
    };
    let mut config = spec.qp;
    config.max_send_wr = max_send_wr;
    config.remote_access = remote_access;
    pd.create_qp(&cq, &cq, &config).expect("create_qp")
}

#[derive(Default)]
struct Progress {
    rounds: AtomicU64,
    bad: AtomicU64,
    errors: Mutex<Vec<String>>,
}

/// The exporting side: checks every WRITE that lands in its memory (through
/// the window) and acknowledges it.
struct Exporter {
    memory: Arc<MemoryRegion>,
    progress: Arc<Progress>,
}

impl Handler for Exporter {
    fn on_message(&mut self, _: &mut Ctx<'_>, _: ConnId, _: &[u8], _: Option<u32>) {}

    fn on_write_imm(&mut self, ctx: &mut Ctx<'_>, conn: ConnId, seq: u32, len: u32) {
        let offset = slot_of(u64::from(seq));
        if len as usize != MSG || read_back(&self.memory, offset, MSG) != pattern(seq as u8, MSG) {
            self.progress.bad.fetch_add(1, Ordering::Relaxed);
        }
        if let Err(err) = ctx.send(conn, b"ack", Some(seq)) {
            self.progress
                .errors
                .lock()
                .unwrap()
                .push(format!("exporter send: {err}"));
        }
    }

    fn on_error(&mut self, ctx: &mut Ctx<'_>, _: ConnId, error: &Error) {
        self.progress
            .errors
            .lock()
            .unwrap()
            .push(format!("exporter: {error}"));
        ctx.stop();
    }
}

/// The peer: WRITEs a pattern through the window with an immediate, waits
/// for the acknowledgement, READs it back through the window and checks it.
struct WindowUser {
    window: RemoteRegion,
    src: MemoryRegion,
    dst: MemoryRegion,
    seq: u64,
    progress: Arc<Progress>,
}

fn slot_of(seq: u64) -> usize {
    (seq as usize % 8) * MSG
}

impl WindowUser {
    fn write_next(&mut self, ctx: &mut Ctx<'_>, conn: ConnId) {
        let seq = self.seq;
        self.src.write(0, &pattern(seq as u8, MSG)).unwrap();
        let target = self.window.slice(slot_of(seq) as u64, MSG as u64).unwrap();
        let local = self.src.slice(0, MSG).unwrap();
        if let Err(err) = ctx.write(conn, &local, target, Some(seq as u32)) {
            self.progress
                .errors
                .lock()
                .unwrap()
                .push(format!("user write {seq}: {err}"));
            ctx.stop();
        }
    }
}

impl Handler for WindowUser {
    fn on_established(&mut self, ctx: &mut Ctx<'_>, conn: ConnId) {
        self.write_next(ctx, conn);
    }

    fn on_message(&mut self, ctx: &mut Ctx<'_>, conn: ConnId, _: &[u8], imm: Option<u32>) {
        if imm != Some(self.seq as u32) {
            self.progress.bad.fetch_add(1, Ordering::Relaxed);
        }
        let source = self
            .window
            .slice(slot_of(self.seq) as u64, MSG as u64)
            .unwrap();
        let local = self.dst.slice(0, MSG).unwrap();
        if let Err(err) = ctx.read(conn, &local, source) {
            self.progress
                .errors
                .lock()
                .unwrap()
                .push(format!("user read: {err}"));
            ctx.stop();
        }
        ctx.signal_staged(conn);
    }

    fn on_read_complete(&mut self, ctx: &mut Ctx<'_>, conn: ConnId, _: u32) {
        if read_back(&self.dst, 0, MSG) != pattern(self.seq as u8, MSG) {
            self.progress.bad.fetch_add(1, Ordering::Relaxed);
        }
        self.seq += 1;
        self.progress.rounds.store(self.seq, Ordering::Relaxed);
        if self.seq == ROUNDS {
            ctx.stop();
        } else {
            self.write_next(ctx, conn);
        }
    }

    fn on_error(&mut self, ctx: &mut Ctx<'_>, _: ConnId, error: &Error) {
        self.progress
            .errors
            .lock()
            .unwrap()
            .push(format!("user: {error}"));
        ctx.stop();
    }
}

verbs_test! {
    fn a_reactor_serves_a_qp_with_windows_bound_on_it() {
        const WINDOWS: u32 = 3;
        let ctx = open_device();
        let pd = ctx.alloc_pd().unwrap();
        let config = small_reactor_config();
        let mut reactor: Reactor<BoxedHandler, ()> = Reactor::new(&pd, config.clone()).unwrap();
        // Room for the reactor's depth and the binds.
        let mut exporting = reactor_qp(&mut reactor, &pd, config.sq_depth + WINDOWS, RW);
        let mut user = reactor_qp(&mut reactor, &pd, config.sq_depth, AccessFlags::empty());
        let (e, u) = (exporting.endpoint(), user.endpoint());
        exporting.connect(&u).unwrap();
        user.connect(&e).unwrap();

        let memory = Arc::new(pd.alloc_mr(4096, WINDOWS_ONLY).unwrap());
        // Unsignaled binds: the reactor's CQ is not ours to poll. Windows
        // for other peers on the same QP are just as fine.
        let windows: Vec<BoundWindow> = (0..WINDOWS)
            .map(|_| {
                exporting
                    .bind_window(pd.alloc_mw().unwrap(), memory.registration(), RW, SendFlags::empty())
                    .expect("bind")
            })
            .collect();
        assert_eq!((exporting.bound_windows(), exporting.has_posted()), (WINDOWS, false));
        // The windows stay bound while they live: dropping one revokes it.
        let window = windows[0].remote();

        let progress = Arc::new(Progress::default());
        let exporter = reactor
            .add(
                vec![exporting],
                Box::new(Exporter {
                    memory: Arc::clone(&memory),
                    progress: Arc::clone(&progress),
                }),
            )
            .expect("the reactor takes a QP with windows bound on it");
        reactor
            .add(
                vec![user],
                Box::new(WindowUser {
                    window,
                    src: pd.alloc_mr(4096, AccessFlags::LOCAL_WRITE).unwrap(),
                    dst: pd.alloc_mr(4096, AccessFlags::LOCAL_WRITE).unwrap(),
                    seq: 0,
                    progress: Arc::clone(&progress),
                }),
            )
            .unwrap();
        let start = Instant::now();
        while progress.rounds.load(Ordering::Relaxed) < ROUNDS
            && progress.errors.lock().unwrap().is_empty()
        {
            reactor.turn().expect("reactor pass");
            assert!(start.elapsed() < DEADLINE, "timed out: {} rounds", progress.rounds.load(Ordering::Relaxed));
        }
        assert_eq!(*progress.errors.lock().unwrap(), Vec::<String>::new());
        assert_eq!(progress.rounds.load(Ordering::Relaxed), ROUNDS);
        assert_eq!(progress.bad.load(Ordering::Relaxed), 0, "every WRITE and READ through the window checked out");
        assert_eq!(ignored(&reactor), (0, 0), "no completion was taken for a foreign one");

        // The peer goes: removing its session destroys its QP, which takes
        // the windows bound on it along (promptly: none is left bound).
        let start = Instant::now();
        reactor.remove(exporter).expect("the exporter's session");
        assert!(start.elapsed() < Duration::from_secs(10), "removal took {:?}", start.elapsed());
        assert!(windows.iter().all(BoundWindow::is_revoked));
    }
}

verbs_test! {
    fn a_reactor_refuses_a_qp_whose_binds_leave_it_no_send_queue() {
        let ctx = open_device();
        let pd = ctx.alloc_pd().unwrap();
        let config = small_reactor_config();
        let mut reactor: Reactor<BoxedHandler, ()> = Reactor::new(&pd, config).unwrap();
        let mut exporting = reactor_qp(&mut reactor, &pd, 7, RW);
        let mut user = reactor_qp(&mut reactor, &pd, 7, AccessFlags::empty());
        let (e, u) = (exporting.endpoint(), user.endpoint());
        exporting.connect(&u).unwrap();
        user.connect(&e).unwrap();
        let memory = pd.alloc_mr(4096, WINDOWS_ONLY).unwrap();
        // Leave three entries: fewer than a connection works with.
        let binds = exporting.max_send_wr() - 3;
        let _windows: Vec<BoundWindow> = (0..binds)
            .map(|_| {
                exporting
                    .bind_window(pd.alloc_mw().unwrap(), memory.registration(), RW, SendFlags::empty())
                    .expect("bind")
            })
            .collect();
        let progress = Arc::new(Progress::default());
        let refused = reactor
            .add(
                vec![exporting],
                Box::new(Exporter {
                    memory: Arc::new(pd.alloc_mr(64, AccessFlags::LOCAL_WRITE).unwrap()),
                    progress,
                }),
            )
            .expect_err("binds leave the reactor 3 send-queue entries");
        assert!(matches!(refused, Error::InvalidArgument(_)), "{refused}");
        assert!(refused.to_string().contains("binds"), "{refused}");
        assert_eq!(reactor.sessions().count(), 0, "the reactor is as it was");
    }
}
