//! What a reactor has done so far: plain counters it bumps as it goes (no
//! atomics on the data path), read between passes.

/// Running totals of one reactor, since it was created.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Counters {
    /// Passes that polled every CQ
    /// ([`Reactor::poll_once`](super::Reactor::poll_once) calls, directly
    /// or through `turn`, `run` and `prepare_wait`).
    pub passes: u64,
    /// Passes that found no completion.
    pub empty_passes: u64,
    /// Completions polled from the reactor's CQs (credit updates and
    /// unsignaled-tail signals included).
    pub completions: u64,
    /// Messages handed to handlers: SENDs (`on_message`) and
    /// WRITE_WITH_IMMs (`on_write_imm`), not credit updates.
    pub messages: u64,
    /// Datagrams handed to handlers (`on_datagram`).
    pub datagrams: u64,
    /// Send-queue requests posted (SENDs, WRITEs, READs, forwards, credit
    /// updates).
    pub requests: u64,
    /// Doorbells rung: one `ibv_post_send` per QP per pass with staged work.
    pub doorbells: u64,
    /// Times the reactor went to sleep (Blocking and Epoll modes).
    pub sleeps: u64,
    /// Connections the end-of-pass flushes looked at: those the pass's
    /// completions and handlers touched, and, when the reactor is idle,
    /// those left with receives or unsignaled requests for later. Not every
    /// connection every pass: a busy connection among a thousand quiet ones
    /// costs what it costs alone.
    pub flush_visits: u64,
    /// Completions ignored because nothing of the reactor's own posted
    /// them (see [`QpSource`](super::QpSource); the window binds of a QP
    /// it serves are not counted).
    pub foreign_completions: u64,
    /// Completions ignored because their connection or datagram endpoint
    /// was removed since it posted the request or receive: what completed
    /// before its QP went, and the receives the removal flushed, polled by
    /// the pass after the removal. Expected after a removal, unlike
    /// [`foreign_completions`](Self::foreign_completions); how many the CQ
    /// still holds is the provider's (Soft-RoCE keeps them, mlx5 cleans a
    /// destroyed QP's from its CQ). A removed connection's SRQ receives
    /// count as [`reclaimed_receives`](Self::reclaimed_receives) instead.
    pub stale_completions: u64,
    /// SRQ receives consumed by QPs the reactor does not serve (not yet
    /// added, or removed), whose slots it gave back to the SRQ.
    pub reclaimed_receives: u64,
}

impl Counters {
    /// The share of passes that found nothing to do, from 0 to 1 (0 before
    /// the first pass). In the event modes a sleep ends an empty pass, so
    /// this is the share of passes spent waiting.
    pub fn idle_fraction(&self) -> f64 {
        if self.passes == 0 {
            return 0.0;
        }
        self.empty_passes as f64 / self.passes as f64
    }
}

/// Memory a reactor has registered for its connections' rings: what the
/// NIC may write into (receives) or read from (send slots). Handlers'
/// own buffers are not counted.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct MemoryUse {
    /// Receive rings: every connection's own ring, plus the shared receive
    /// queue's ring (fixed by [`ReactorConfig::srq_depth`](super::ReactorConfig::srq_depth),
    /// whatever the number of connections).
    pub receive_bytes: usize,
    /// Send slots: [`ReactorConfig::send_slots`](super::ReactorConfig::send_slots) per connection.
    pub send_bytes: usize,
    /// Connections counted (closed ones still holding their rings included).
    pub connections: usize,
}

/// Where one connection's send queue, send slots and credits stand, read
/// between passes (for diagnostics and tests).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ConnStats {
    /// Send-queue entries in use: posted or staged, not yet known complete.
    pub sq_used: u32,
    /// Send slots holding a payload that is staged or in flight.
    pub send_slots_used: u32,
    /// RECV-consuming requests (SEND, WRITE_WITH_IMM) the peer has receives
    /// posted for; negative before the peer's first credit update.
    pub credits: i32,
}
