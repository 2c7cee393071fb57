//! Queue pairs: an RC QP's shared state and its state machine
//! (`ibv_modify_qp`), the `post_send`/`post_recv` entries of the ops table,
//! and each request's execution against the peer (SEND, WRITE, READ), its
//! completions, and the flushes of the error state.

use std::collections::VecDeque;
use std::os::raw::c_int;
use std::ptr::{self, NonNull};
use std::sync::atomic::{AtomicU32, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock, Weak};

use crate::sys;

use super::cq::{CqRing, ring_of};
use super::dma::{Spans, copy_spans, resolve};
use super::registry::{KeyMap, MrEntry, NEXT_QPN, QPS, next_handle, read_mrs, take_reused_qpn};
use super::request::{PostedRecv, SendOp, SgList};
use super::srq::{LbSrq, srq_of};
use super::{MAX_INLINE, MAX_QP_WR, MAX_SGE, lock};

mod recv;

use recv::flush_recv_wc;
pub(super) use recv::{post_recv, receive_over_stalled_send, take_recv_list};

/// What executing one send request came to.
enum Outcome {
    /// Done; `peer_failed`: the peer went to the error state meanwhile
    /// (its CQ overflowed), so its stalled requests need flushing.
    Done { len: u32, peer_failed: bool },
    /// No receive posted at the peer: the send queue waits.
    Stall,
    /// Failed with `status`; the requester goes to error.
    Fail {
        status: sys::ibv_wc_status,
        peer_failed: bool,
    },
}

impl Outcome {
    fn fail(status: sys::ibv_wc_status) -> Self {
        Self::Fail {
            status,
            peer_failed: false,
        }
    }
}

/// When the error state flushes a QP's stalled sends.
#[derive(Clone, Copy)]
enum SendFlush {
    /// During the call (destroying the QP: nothing may use it afterwards).
    Now,
    /// When the send CQ is next polled, as a device that flushes its send
    /// queue after `ibv_modify_qp` returns would: until then the sends
    /// still use their memory, and a receive posted over it is refused
    /// (`post_recvs`).
    AtNextPoll,
}

struct SendQueue {
    /// Requests waiting behind a SEND the peer had no receive for (or, in
    /// the error state, for their flush): the device still uses their
    /// memory. Changed only through `stall`, `unstall` and `flush`, which
    /// keep `STALLED` in step.
    stalled: VecDeque<SendOp>,
}

/// Send requests stalled on every QP of the process: while there are none,
/// a receive needs no check against them (see `post_recvs`).
static STALLED: AtomicUsize = AtomicUsize::new(0);

impl SendQueue {
    fn stall(&mut self, op: SendOp) {
        STALLED.fetch_add(1, Ordering::Relaxed);
        self.stalled.push_back(op);
    }

    fn unstall(&mut self) -> Option<SendOp> {
        let op = self.stalled.pop_front()?;
        STALLED.fetch_sub(1, Ordering::Relaxed);
        Some(op)
    }

    /// Completes every stalled request with `IBV_WC_WR_FLUSH_ERR` on `cq`.
    fn flush(&mut self, qpn: u32, cq: &CqRing) {
        while let Some(op) = self.unstall() {
            cq.push(op.wc(qpn, sys::IBV_WC_WR_FLUSH_ERR, 0));
        }
    }
}

struct RecvQueue {
    posted: VecDeque<PostedRecv>,
    /// The peer's send queue stalled on this receive queue: the next post
    /// runs it.
    peer_waiting: bool,
}

/// A loopback QP's state, shared with peers that look it up.
pub(super) struct LbQp {
    qpn: u32,
    pd: u32,
    send_cq: Arc<CqRing>,
    recv_cq: Arc<CqRing>,
    pub(super) sig_all: bool,
    max_send_wr: usize,
    max_recv_wr: usize,
    pub(super) max_send_sge: usize,
    max_recv_sge: usize,
    pub(super) max_inline: u32,
    /// The SRQ its receives come from (its own receive queue stays empty).
    srq: Option<Arc<LbSrq>>,
    /// `IBV_QPS_*`; changes to ERR only under the receive-queue lock.
    state: AtomicU32,
    /// `IBV_ACCESS_REMOTE_*` rights peers have on this QP.
    remote_access: AtomicU32,
    peer: OnceLock<Weak<LbQp>>,
    sq: Mutex<SendQueue>,
    rq: Mutex<RecvQueue>,
}

/// A loopback QP: the verbs struct the crate holds, then the shared state.
#[repr(C)]
struct QpObj {
    /// First, so an `*mut ibv_qp` of ours is an `*mut QpObj`.
    qp: sys::ibv_qp,
    lb: Arc<LbQp>,
}

/// The state of a loopback QP.
///
/// # Safety
/// `qp` is a live QP from [`create_qp`], alive for `'a`.
unsafe fn qp_of<'a>(qp: *mut sys::ibv_qp) -> &'a Arc<LbQp> {
    // SAFETY: our QPs are QpObjs with the ibv_qp first (repr(C)); only the
    // `lb` field is borrowed, which nobody writes after creation.
    unsafe { &(*qp.cast::<QpObj>()).lb }
}

/// Creates an RC QP in `pd` on the CQs of `init` (taking its receives
/// from `init.srq` if set) and writes the granted capabilities back.
/// Destroy it with [`destroy_qp`].
///
/// # Safety
/// `pd` is a live PD from [`alloc_pd`](super::alloc_pd); `init.send_cq`
/// and `init.recv_cq` are live CQs from [`create_cq`](super::create_cq);
/// `init.srq` is NULL or a live SRQ from [`create_srq`](super::create_srq).
pub(crate) unsafe fn create_qp(
    pd: NonNull<sys::ibv_pd>,
    init: &mut sys::ibv_qp_init_attr,
) -> Result<NonNull<sys::ibv_qp>, c_int> {
    if init.qp_type != sys::IBV_QPT_RC {
        return Err(libc::EOPNOTSUPP);
    }
    let cap = &mut init.cap;
    if cap.max_send_wr > MAX_QP_WR
        || cap.max_recv_wr > MAX_QP_WR
        || cap.max_send_sge as usize > MAX_SGE
        || cap.max_recv_sge as usize > MAX_SGE
        || cap.max_inline_data > MAX_INLINE
        || init.send_cq.is_null()
        || init.recv_cq.is_null()
    {
        return Err(libc::EINVAL);
    }
    cap.max_send_wr = cap.max_send_wr.max(1);
    cap.max_recv_wr = cap.max_recv_wr.max(1);
    // SAFETY: the caller vouches for the PD, both CQs and the SRQ (if any).
    let (context, pd_handle, send_cq, recv_cq, srq) = unsafe {
        (
            (*pd.as_ptr()).context,
            (*pd.as_ptr()).handle,
            Arc::clone(ring_of(init.send_cq)),
            Arc::clone(ring_of(init.recv_cq)),
            (!init.srq.is_null()).then(|| Arc::clone(srq_of(init.srq))),
        )
    };
    let mut qps = lock(&QPS);
    let reused =
        take_reused_qpn().filter(|&qpn| qps.get(&qpn).is_none_or(|qp| qp.strong_count() == 0));
    let qpn = reused.unwrap_or_else(|| {
        loop {
            let qpn = NEXT_QPN.fetch_add(1, Ordering::Relaxed) & 0x00ff_ffff;
            // 0 and 1 are the special QPs of InfiniBand.
            if qpn > 1 && qps.get(&qpn).is_none_or(|qp| qp.strong_count() == 0) {
                break qpn;
            }
        }
    });
    let lb = Arc::new(LbQp {
        qpn,
        pd: pd_handle,
        send_cq,
        recv_cq,
        sig_all: init.sq_sig_all != 0,
        max_send_wr: cap.max_send_wr as usize,
        max_recv_wr: cap.max_recv_wr as usize,
        max_send_sge: cap.max_send_sge as usize,
        max_recv_sge: cap.max_recv_sge as usize,
        max_inline: cap.max_inline_data,
        srq,
        state: AtomicU32::new(sys::IBV_QPS_RESET),
        remote_access: AtomicU32::new(0),
        peer: OnceLock::new(),
        sq: Mutex::new(SendQueue {
            stalled: VecDeque::new(),
        }),
        rq: Mutex::new(RecvQueue {
            posted: VecDeque::with_capacity(cap.max_recv_wr as usize),
            peer_waiting: false,
        }),
    });
    qps.insert(qpn, Arc::downgrade(&lb));
    drop(qps);
    let obj = Box::new(QpObj {
        qp: sys::ibv_qp {
            context,
            pd: pd.as_ptr(),
            send_cq: init.send_cq,
            recv_cq: init.recv_cq,
            handle: next_handle(),
            qp_num: qpn,
            state: sys::IBV_QPS_RESET,
            qp_type: sys::IBV_QPT_RC,
            ..Default::default()
        },
        lb,
    });
    Ok(NonNull::from(Box::leak(obj)).cast())
}

/// Destroys a QP from [`create_qp`]: it goes to the error state first
/// (flushing what it holds), then leaves the registry.
///
/// # Safety
/// `qp` came from [`create_qp`] and is destroyed once; no call on it runs.
pub(crate) unsafe fn destroy_qp(qp: NonNull<sys::ibv_qp>) {
    // SAFETY: a Box<QpObj> from create_qp, released once.
    let obj = unsafe { Box::from_raw(qp.as_ptr().cast::<QpObj>()) };
    obj.lb.enter_error(SendFlush::Now);
    let mut qps = lock(&QPS);
    if qps
        .get(&obj.lb.qpn)
        .is_some_and(|w| ptr::eq(w.as_ptr(), Arc::as_ptr(&obj.lb)))
    {
        qps.remove(&obj.lb.qpn);
    }
}

/// `ibv_modify_qp` for a loopback QP: RESET→INIT, INIT→RTR (finding the
/// peer by `dest_qp_num`), RTR→RTS and any→ERR. Returns an errno.
///
/// # Safety
/// `qp` is a live QP from [`create_qp`].
pub(crate) unsafe fn modify_qp(
    qp: NonNull<sys::ibv_qp>,
    attr: &sys::ibv_qp_attr,
    mask: u32,
) -> c_int {
    // SAFETY: the caller vouches for the QP.
    let lb = unsafe { qp_of(qp.as_ptr()) };
    if mask & sys::IBV_QP_STATE == 0 {
        return 0;
    }
    let current = lb.state();
    let allowed = match attr.qp_state {
        sys::IBV_QPS_INIT => matches!(current, sys::IBV_QPS_RESET | sys::IBV_QPS_INIT),
        sys::IBV_QPS_RTR => current == sys::IBV_QPS_INIT,
        sys::IBV_QPS_RTS => matches!(current, sys::IBV_QPS_RTR | sys::IBV_QPS_RTS),
        sys::IBV_QPS_ERR => true,
        _ => false,
    };
    if !allowed {
        return libc::EINVAL;
    }
    if mask & sys::IBV_QP_ACCESS_FLAGS != 0 {
        lb.remote_access
            .store(attr.qp_access_flags, Ordering::Release);
    }
    match attr.qp_state {
        sys::IBV_QPS_ERR => {
            lb.enter_error(SendFlush::AtNextPoll);
            0
        }
        sys::IBV_QPS_RTR => {
            if mask & sys::IBV_QP_DEST_QPN == 0 {
                return libc::EINVAL;
            }
            let peer = lock(&QPS).get(&attr.dest_qp_num).cloned();
            let Some(peer) = peer.filter(|qp| qp.strong_count() > 0) else {
                // No loopback QP has that number (a NIC would accept it and
                // time out later; here the mistake shows at once).
                return libc::ENOENT;
            };
            if lb.peer.set(peer).is_err() {
                return libc::EINVAL;
            }
            lb.set_state(sys::IBV_QPS_RTR)
        }
        state => lb.set_state(state),
    }
}

/// The state of a loopback QP (`IBV_QPS_*`).
///
/// # Safety
/// `qp` is a live QP from [`create_qp`].
pub(crate) unsafe fn query_qp_state(qp: NonNull<sys::ibv_qp>) -> sys::ibv_qp_state {
    // SAFETY: the caller vouches for the QP.
    unsafe { qp_of(qp.as_ptr()) }.state()
}

impl LbQp {
    fn state(&self) -> u32 {
        self.state.load(Ordering::Acquire)
    }

    /// A state change other than to ERR, under both locks (so it orders
    /// with posts and deliveries). Returns 0 (or EINVAL if the QP failed
    /// meanwhile).
    fn set_state(&self, state: u32) -> c_int {
        let _sq = lock(&self.sq);
        let _rq = lock(&self.rq);
        if self.state() == sys::IBV_QPS_ERR {
            return libc::EINVAL;
        }
        self.state.store(state, Ordering::Release);
        0
    }

    /// True if the QP takes incoming requests.
    fn accepts(&self) -> bool {
        matches!(self.state(), sys::IBV_QPS_RTR | sys::IBV_QPS_RTS)
    }

    fn peer(&self) -> Option<Arc<LbQp>> {
        self.peer.get().and_then(Weak::upgrade)
    }

    /// True if this QP's peer is `other` (set once, by `modify_qp` to RTR).
    fn is_connected_to(&self, other: &LbQp) -> bool {
        self.peer
            .get()
            .is_some_and(|peer| std::ptr::eq(peer.as_ptr(), other))
    }

    /// Moves to ERR with the receive queue locked, flushing its receives
    /// (an SRQ's stay posted, for its other QPs, as on a NIC). True if the
    /// QP was not in ERR before.
    fn fail_locked(&self, rq: &mut RecvQueue) -> bool {
        if self.state() == sys::IBV_QPS_ERR {
            return false;
        }
        self.state.store(sys::IBV_QPS_ERR, Ordering::Release);
        rq.peer_waiting = false;
        for recv in rq.posted.drain(..) {
            self.recv_cq.push(flush_recv_wc(recv.wr_id, self.qpn));
        }
        true
    }

    /// Moves to ERR with the send queue locked: receives, then stalled
    /// sends, are flushed. True if the QP was not in ERR before.
    fn fail_sq(&self, sq: &mut SendQueue) -> bool {
        let newly = self.fail_locked(&mut lock(&self.rq));
        sq.flush(self.qpn, &self.send_cq);
        newly
    }

    /// The deferred flush of `enter_error(SendFlush::AtNextPoll)`.
    pub(super) fn flush_stalled(&self) {
        lock(&self.sq).flush(self.qpn, &self.send_cq);
    }

    /// A receive was posted on the SRQ this QP is on: its peer's send
    /// queue, if it stalled on the SRQ, runs.
    pub(super) fn receive_posted(&self) {
        if let Some(peer) = self.peer() {
            peer.progress();
        }
    }

    /// True if a stalled send of this QP still uses memory of `list`.
    fn stalled_use(&self, list: &SgList) -> bool {
        lock(&self.sq).stalled.iter().any(|op| op.uses(list))
    }

    /// `ibv_modify_qp(ERR)` and destroy: the receives are flushed now, the
    /// stalled sends as `sends` says, then the peer finds out (its stalled
    /// sends to us fail).
    fn enter_error(self: &Arc<Self>, sends: SendFlush) {
        let newly = {
            let mut sq = lock(&self.sq);
            match sends {
                SendFlush::Now => self.fail_sq(&mut sq),
                SendFlush::AtNextPoll => {
                    let newly = self.fail_locked(&mut lock(&self.rq));
                    if !sq.stalled.is_empty() {
                        self.send_cq.defer_flush(Arc::downgrade(self));
                    }
                    newly
                }
            }
        };
        if newly && let Some(peer) = self.peer() {
            peer.progress();
        }
    }

    /// Runs stalled sends until one stalls again (or flushes them, in ERR).
    fn progress(&self) {
        let peer = self.peer();
        let mut kick = false;
        {
            let mut sq = lock(&self.sq);
            if self.state() == sys::IBV_QPS_ERR {
                kick = self.fail_sq(&mut sq);
            }
            while let Some(op) = sq.stalled.front() {
                match self.execute(op, peer.as_deref()) {
                    Outcome::Stall => break,
                    outcome => {
                        let Some(op) = sq.unstall() else {
                            break;
                        };
                        kick |= self.complete(&mut sq, &op, outcome);
                    }
                }
            }
        }
        if kick && let Some(peer) = peer {
            peer.progress();
        }
    }

    /// Posts the completion of a request that ran (not stalled); true if
    /// the peer must be kicked afterwards.
    fn complete(&self, sq: &mut SendQueue, op: &SendOp, outcome: Outcome) -> bool {
        match outcome {
            Outcome::Stall => false,
            Outcome::Done { len, peer_failed } => {
                let overflow =
                    op.signaled && !self.send_cq.push(op.wc(self.qpn, sys::IBV_WC_SUCCESS, len));
                let failed = overflow && self.fail_sq(sq);
                failed || peer_failed
            }
            Outcome::Fail {
                status,
                peer_failed,
            } => {
                self.send_cq.push(op.wc(self.qpn, status, 0));
                self.fail_sq(sq) || peer_failed
            }
        }
    }

    /// Runs one request against `peer`.
    fn execute(&self, op: &SendOp, peer: Option<&LbQp>) -> Outcome {
        let Some(peer) = peer else {
            return Outcome::fail(sys::IBV_WC_RETRY_EXC_ERR);
        };
        // A responder takes requests only from the QP it is connected to (a
        // NIC drops the packets of any other, whose requester then runs out
        // of retries): without this, any QP that learned a QP number could
        // reach that QP's receives and memory, and the stalled-send wakeup,
        // which goes to the receiver's own peer only, would be lost.
        if !peer.is_connected_to(self) {
            return Outcome::fail(sys::IBV_WC_RETRY_EXC_ERR);
        }
        match op.opcode {
            sys::IBV_WR_RDMA_WRITE => self.write(op, peer),
            sys::IBV_WR_RDMA_READ => self.read(op, peer),
            _ => self.deliver(op, peer),
        }
    }

    /// RDMA WRITE: our gather list into the peer's memory.
    fn write(&self, op: &SendOp, peer: &LbQp) -> Outcome {
        if !peer.accepts() {
            return Outcome::fail(sys::IBV_WC_RETRY_EXC_ERR);
        }
        let mrs = read_mrs();
        let Some(src) = op.source(&mrs, self.pd) else {
            return Outcome::fail(sys::IBV_WC_LOC_PROT_ERR);
        };
        let Some(dst) = peer.remote_target(&mrs, op, src.total(), sys::IBV_ACCESS_REMOTE_WRITE)
        else {
            return Outcome::fail(sys::IBV_WC_REM_ACCESS_ERR);
        };
        // SAFETY: both sides resolved against the MR table, whose read lock
        // we hold (inline data is the poster's, valid for the call).
        unsafe { copy_spans(&src, &dst) };
        Outcome::Done {
            len: src.total() as u32,
            peer_failed: false,
        }
    }

    /// RDMA READ: the peer's memory into our scatter list.
    fn read(&self, op: &SendOp, peer: &LbQp) -> Outcome {
        if !peer.accepts() {
            return Outcome::fail(sys::IBV_WC_RETRY_EXC_ERR);
        }
        let mrs = read_mrs();
        let Some(dst) = op.sgl.resolve(&mrs, self.pd, sys::IBV_ACCESS_LOCAL_WRITE) else {
            return Outcome::fail(sys::IBV_WC_LOC_PROT_ERR);
        };
        let Some(src) = peer.remote_target(&mrs, op, dst.total(), sys::IBV_ACCESS_REMOTE_READ)
        else {
            return Outcome::fail(sys::IBV_WC_REM_ACCESS_ERR);
        };
        // SAFETY: as in `write`.
        unsafe { copy_spans(&src, &dst) };
        Outcome::Done {
            len: dst.total() as u32,
            peer_failed: false,
        }
    }

    /// The range of our memory a peer's WRITE or READ of `len` bytes names,
    /// if the QP and the MR grant `right`.
    fn remote_target(
        &self,
        mrs: &KeyMap<MrEntry>,
        op: &SendOp,
        len: u64,
        right: u32,
    ) -> Option<Spans> {
        if len == 0 {
            // Zero-length RDMA checks no key (the IB rule).
            return Some(Spans::new());
        }
        if self.remote_access.load(Ordering::Acquire) & right == 0 {
            return None;
        }
        resolve(mrs, op.rkey, op.remote_addr, len, self.pd, right).map(Spans::one)
    }

    /// SEND, SEND_WITH_IMM and WRITE_WITH_IMM: consumes the peer's oldest
    /// receive, of its SRQ if it has one (or stalls without one).
    fn deliver(&self, op: &SendOp, peer: &LbQp) -> Outcome {
        let mut rq = lock(&peer.rq);
        if !peer.accepts() {
            return Outcome::fail(sys::IBV_WC_RETRY_EXC_ERR);
        }
        // The SRQ's lock is taken inside the receive-queue lock, which
        // orders the delivery with the peer's move to ERR.
        let mut srq = peer.srq.as_deref().map(|srq| (srq.pd, srq.queue()));
        let (posted, recv_pd) = match &mut srq {
            Some((pd, queue)) => (&mut queue.posted, *pd),
            None => (&mut rq.posted, peer.pd),
        };
        let Some(recv) = posted.front().copied() else {
            match &mut srq {
                Some((_, queue)) => queue.wait(peer.qpn),
                None => rq.peer_waiting = true,
            }
            return Outcome::Stall;
        };
        let mrs = read_mrs();
        let Some(src) = op.source(&mrs, self.pd) else {
            return Outcome::fail(sys::IBV_WC_LOC_PROT_ERR);
        };
        let len = src.total();
        let mut wc = sys::ibv_wc {
            wr_id: recv.wr_id,
            status: sys::IBV_WC_SUCCESS,
            opcode: sys::IBV_WC_RECV,
            byte_len: len as u32,
            qp_num: peer.qpn,
            src_qp: self.qpn,
            ..Default::default()
        };
        if op.opcode != sys::IBV_WR_SEND {
            wc.wc_flags = sys::IBV_WC_WITH_IMM;
            wc.__bindgen_anon_1.imm_data = op.imm;
        }
        if op.opcode == sys::IBV_WR_RDMA_WRITE_WITH_IMM {
            let Some(dst) = peer.remote_target(&mrs, op, len, sys::IBV_ACCESS_REMOTE_WRITE) else {
                return Outcome::fail(sys::IBV_WC_REM_ACCESS_ERR);
            };
            // SAFETY: as in `write`.
            unsafe { copy_spans(&src, &dst) };
            wc.opcode = sys::IBV_WC_RECV_RDMA_WITH_IMM;
        } else {
            let dst = recv.sgl.resolve(&mrs, recv_pd, sys::IBV_ACCESS_LOCAL_WRITE);
            let failure = match dst {
                None => Some((sys::IBV_WC_LOC_PROT_ERR, sys::IBV_WC_REM_OP_ERR)),
                Some(dst) if dst.total() < len => {
                    Some((sys::IBV_WC_LOC_LEN_ERR, sys::IBV_WC_REM_INV_REQ_ERR))
                }
                Some(dst) => {
                    // SAFETY: as in `write`.
                    unsafe { copy_spans(&src, &dst) };
                    None
                }
            };
            if let Some((theirs, ours)) = failure {
                drop(mrs);
                posted.pop_front();
                wc.status = theirs;
                peer.recv_cq.push(wc);
                let peer_failed = peer.fail_locked(&mut rq);
                return Outcome::Fail {
                    status: ours,
                    peer_failed,
                };
            }
        }
        drop(mrs);
        posted.pop_front();
        let peer_failed = !peer.recv_cq.push(wc) && peer.fail_locked(&mut rq);
        Outcome::Done {
            len: len as u32,
            peer_failed,
        }
    }

    /// `ibv_post_send`.
    ///
    /// # Safety
    /// `head` starts a NULL-terminated list of valid requests whose SGE
    /// lists (and inline data) are valid for the call; `bad` is writable.
    unsafe fn post_sends(
        &self,
        head: *mut sys::ibv_send_wr,
        bad: *mut *mut sys::ibv_send_wr,
    ) -> c_int {
        let peer = self.peer();
        let mut kick = false;
        let rc = 'post: {
            let mut sq = lock(&self.sq);
            if !matches!(self.state(), sys::IBV_QPS_RTS | sys::IBV_QPS_ERR) {
                // SAFETY: `bad` is writable (the caller).
                unsafe { *bad = head };
                break 'post libc::EINVAL;
            }
            #[cfg(test)]
            let mut limit = super::registry::take_send_limit(self.qpn);
            let mut cur = head;
            while !cur.is_null() {
                #[cfg(test)]
                if limit.refuses_next() {
                    if limit.says_where() {
                        // SAFETY: `bad` is writable.
                        unsafe { *bad = cur };
                    }
                    break 'post libc::ENOMEM;
                }
                // SAFETY: a valid request of the caller's list.
                let wr = unsafe { &*cur };
                // SAFETY: as the caller vouches for the list.
                let op = match unsafe { SendOp::from_raw(wr, self) } {
                    Ok(op) => op,
                    Err(errno) => {
                        // SAFETY: `bad` is writable.
                        unsafe { *bad = cur };
                        break 'post errno;
                    }
                };
                if self.state() == sys::IBV_QPS_ERR && sq.stalled.is_empty() {
                    self.send_cq
                        .push(op.wc(self.qpn, sys::IBV_WC_WR_FLUSH_ERR, 0));
                } else if !sq.stalled.is_empty() {
                    // Behind stalled requests (or their pending flush, in
                    // ERR): the send queue completes in order.
                    if sq.stalled.len() >= self.max_send_wr {
                        // SAFETY: `bad` is writable.
                        unsafe { *bad = cur };
                        break 'post libc::ENOMEM;
                    }
                    // SAFETY: still inside the post call.
                    sq.stall(unsafe { op.detach() });
                } else {
                    match self.execute(&op, peer.as_deref()) {
                        // SAFETY: still inside the post call.
                        Outcome::Stall => sq.stall(unsafe { op.detach() }),
                        outcome => kick |= self.complete(&mut sq, &op, outcome),
                    }
                }
                cur = wr.next;
            }
            0
        };
        if kick && let Some(peer) = peer {
            peer.progress();
        }
        rc
    }
}

pub(super) unsafe extern "C" fn post_send(
    qp: *mut sys::ibv_qp,
    wr: *mut sys::ibv_send_wr,
    bad: *mut *mut sys::ibv_send_wr,
) -> c_int {
    // SAFETY: libibverbs' contract: `qp` is a live QP of this context (one
    // of ours), `wr` a valid list, `bad` writable.
    unsafe { qp_of(qp).post_sends(wr, bad) }
}
