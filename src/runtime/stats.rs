//! What each reactor of a runtime reports ([`ReactorStats`]).

use std::fmt;

use crate::reactor::Counters;

#[cfg(doc)]
use super::RuntimeConfig;
use super::SubmitLatency;

/// What one reactor has done, as last published (before each sleep, every
/// 1024 passes, and when it stopped).
#[derive(Debug, Clone, PartialEq)]
pub struct ReactorStats {
    /// The reactor's index.
    pub reactor: usize,
    /// The core it is pinned to.
    pub core: Option<usize>,
    /// Its thread's OS id (for `perf`, `top -H`, `/proc`).
    pub thread_id: u64,
    /// Still running.
    pub running: bool,
    /// Sessions it serves.
    pub sessions: usize,
    /// Commands from submission rings it staged.
    pub commands: u64,
    /// Passes, completions, messages, requests, doorbells, sleeps.
    pub counters: Counters,
    /// How long submitted commands waited until their doorbell, with
    /// [`RuntimeConfig::trace_submissions`].
    pub submit_latency: Option<SubmitLatency>,
}

impl ReactorStats {
    /// The share of passes that found nothing to do (see
    /// [`Counters::idle_fraction`]).
    pub fn idle_fraction(&self) -> f64 {
        self.counters.idle_fraction()
    }
}

impl fmt::Display for ReactorStats {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let c = &self.counters;
        let core = self
            .core
            .map_or("unpinned".to_string(), |core| format!("core {core}"));
        write!(
            f,
            "reactor {} ({core}): {} sessions, {} passes ({:.0} % idle), {} completions, {} messages, {} requests in {} doorbells, {} sleeps, {} submitted commands",
            self.reactor,
            self.sessions,
            c.passes,
            100.0 * self.idle_fraction(),
            c.completions,
            c.messages,
            c.requests,
            c.doorbells,
            c.sleeps,
            self.commands
        )?;
        if let Some(latency) = &self.submit_latency {
            write!(
                f,
                "; submit to doorbell: p50 {:.1} us, p99 {:.1} us, max {:.1} us over {} commands",
                latency.p50_ns as f64 / 1e3,
                latency.p99_ns as f64 / 1e3,
                latency.max_ns as f64 / 1e3,
                latency.samples
            )?;
        }
        Ok(())
    }
}
