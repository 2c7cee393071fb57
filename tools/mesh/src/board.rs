//! What crosses peers within one rank. Each peer session has a handler of
//! its own, on whichever reactor serves it; they share only this board:
//! this rank's row of [`Cell`]s (each handler posts its cell when both
//! streams with its peer are over), the rows rank 0 gathers, whether our
//! row reached rank 0, the first failure, the peers that left, and the
//! decision to give up. Handlers touch it at phase boundaries only (a
//! lock at the end of a stream, an atomic load on idle passes), never per
//! message. The main thread waits on it ([`Board::supervise`]).

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Condvar, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use rdma_comm_core::runtime::RuntimeHandle;

use crate::wire::{CELL_BYTES, Cell};

/// After a peer leaves, completions it caused may still be queued: it
/// counts as lost only if it still owes something this much later.
pub const LAST_WORDS: Duration = Duration::from_millis(500);
/// How often the main thread looks at the board when nothing changed (for
/// [`LAST_WORDS`], the connect deadline and the reactors' health).
const LOOK: Duration = Duration::from_millis(50);

/// A failure: the rank to blame, if any, and what happened.
pub type Failure = (Option<usize>, String);

/// [`Board::abort`] before the rank gives up.
const NO_ABORT: usize = usize::MAX;
/// [`Board::abort`] when the rank gives up over no rank in particular.
const OVER_NOBODY: usize = usize::MAX - 1;

/// One rank's shared state. See the module docs.
#[derive(Debug)]
pub struct Board {
    /// This rank.
    me: usize,
    /// Number of ranks.
    size: usize,
    /// Cells posted: at `size - 1` this rank's row is complete.
    cells_in: AtomicUsize,
    /// [`NO_ABORT`], or the rank this rank gives up over ([`OVER_NOBODY`]).
    abort: AtomicUsize,
    /// Everything else, for phase boundaries only.
    state: Mutex<State>,
    /// Rung on every change of `state`, for the main thread.
    changed: Condvar,
    /// The rank's reactors, woken on every change, so the handler that
    /// must act on it (the one owning rank 0's session, or every handler
    /// when giving up) does so on a reactor that sleeps until woken.
    /// (A handle here closes a cycle through the factory, which holds the
    /// board: `stop_waking` breaks it once the runtime has ended.)
    reactors: Mutex<Option<RuntimeHandle>>,
}

/// The board's locked part.
#[derive(Debug)]
struct State {
    /// This rank's cell towards each peer, by peer rank.
    cells: Vec<Option<Cell>>,
    /// Rank 0 only: every other rank's row, by rank.
    rows: Vec<Option<Vec<Cell>>>,
    /// Peers with a handler (each rank once).
    claimed: Vec<bool>,
    /// Our row reached rank 0 (other ranks).
    row_delivered: bool,
    /// The first failure.
    failure: Option<Failure>,
    /// Peers that left, in the order they did.
    gone: Vec<Departure>,
    /// Handlers that told their peer we give up (or could not).
    told: usize,
    /// Handshakes the listener refused.
    rejected: Vec<String>,
}

/// A peer that left.
#[derive(Debug)]
struct Departure {
    rank: usize,
    since: Instant,
    /// How, in words after "rank N".
    why: String,
    /// The rank to blame if that makes us give up.
    culprit: Option<usize>,
    /// Lost (its connection broke), rather than hung up or gave up: the
    /// likelier cause when several left together.
    lost: bool,
}

impl State {
    /// Whether peer `rank` may leave without anything being lost.
    fn done_with(&self, me: usize, rank: usize) -> bool {
        self.cells[rank].is_some() && (me != 0 || self.rows[rank].is_some())
    }

    /// Whether every rank but `me` has a handler.
    fn claimed_all(&self, me: usize) -> bool {
        self.claimed
            .iter()
            .enumerate()
            .all(|(rank, claimed)| *claimed || rank == me)
    }

    /// Whether rank `me` is done: rank 0 once it is done with every
    /// peer, the others once their row reached rank 0.
    fn finished(&self, me: usize) -> bool {
        if me == 0 {
            (1..self.cells.len()).all(|rank| self.done_with(me, rank))
        } else {
            self.row_delivered
        }
    }

    /// Once the first peer that left owing something did so
    /// [`LAST_WORDS`] ago: every peer that left owing something, and the
    /// culprit of the first that was lost (else of the first). All are
    /// named, and a loss is blamed first, because the first to be noticed
    /// may only have reacted to another (a rank that gave up over a lost
    /// rank before it could tell us so just hangs up).
    fn lost(&self, me: usize) -> Option<Failure> {
        let owing = self
            .gone
            .iter()
            .filter(|gone| !self.done_with(me, gone.rank));
        let first = owing.clone().next()?;
        if first.since.elapsed() <= LAST_WORDS {
            return None;
        }
        let blamed = owing.clone().find(|gone| gone.lost).unwrap_or(first);
        let named: Vec<String> = owing
            .map(|gone| format!("rank {} {}", gone.rank, gone.why))
            .collect();
        Some((blamed.culprit, named.join("; ")))
    }
}

/// Refused handshakes the board keeps for its failure message.
const MAX_REJECTED: usize = 8;

impl Board {
    /// The board of rank `me` of `size`.
    pub fn new(me: usize, size: usize) -> Self {
        Board {
            me,
            size,
            cells_in: AtomicUsize::new(0),
            abort: AtomicUsize::new(NO_ABORT),
            state: Mutex::new(State {
                cells: vec![None; size],
                rows: vec![None; size],
                claimed: vec![false; size],
                row_delivered: false,
                failure: None,
                gone: Vec::new(),
                told: 0,
                rejected: Vec::new(),
            }),
            changed: Condvar::new(),
            reactors: Mutex::new(None),
        }
    }

    /// The runtime whose reactors serve this rank's peers.
    pub fn wake_through(&self, reactors: RuntimeHandle) {
        *self.reactors.lock().unwrap_or_else(PoisonError::into_inner) = Some(reactors);
    }

    /// The runtime has ended: let go of its handle.
    pub fn stop_waking(&self) {
        self.reactors
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take();
    }

    fn wake_reactors(&self) {
        if let Some(reactors) = &*self.reactors.lock().unwrap_or_else(PoisonError::into_inner) {
            reactors.wake_all();
        }
    }

    /// The locked part (a handler that panicked while holding it left
    /// nothing half-done: every change is one assignment).
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Changes the state and tells the main thread.
    fn update<R>(&self, change: impl FnOnce(&mut State) -> R) -> R {
        let result = change(&mut self.lock());
        self.changed.notify_all();
        self.wake_reactors();
        result
    }

    /// Takes `rank` on as a peer with a handler: refused for this rank
    /// itself, a rank outside the job, or one that has a handler already.
    pub fn claim(&self, rank: usize) -> Result<(), String> {
        self.update(|state| match state.claimed.get_mut(rank) {
            Some(claimed) if !*claimed && rank != self.me => {
                *claimed = true;
                Ok(())
            }
            _ => Err(format!(
                "rank {rank} is not a peer rank {} of {} expects",
                self.me, self.size
            )),
        })
    }

    /// Both streams with `rank` are over: this rank's figures towards it.
    pub fn post_cell(&self, rank: usize, cell: Cell) {
        self.update(|state| {
            if state.cells[rank].replace(cell).is_none() {
                self.cells_in.fetch_add(1, Ordering::AcqRel);
            }
        });
    }

    /// Every peer's cell is in (lock-free: for idle passes).
    pub fn row_ready(&self) -> bool {
        self.cells_in.load(Ordering::Acquire) == self.size - 1
    }

    /// Encodes this rank's row into `out` (`size` cells).
    pub fn fill_row(&self, out: &mut [u8]) {
        let state = self.lock();
        for (cell, out) in state.cells.iter().zip(out.chunks_exact_mut(CELL_BYTES)) {
            cell.unwrap_or_default().encode(out);
        }
    }

    /// Rank 0: the row rank `rank` reported.
    pub fn post_row(&self, rank: usize, row: Vec<Cell>) {
        self.update(|state| state.rows[rank] = Some(row));
    }

    /// Our row reached rank 0.
    pub fn row_delivered(&self) {
        self.update(|state| state.row_delivered = true);
    }

    /// Records a failure (the first one counts).
    pub fn fail(&self, culprit: Option<usize>, what: String) {
        self.update(|state| {
            state.failure.get_or_insert((culprit, what));
        });
    }

    /// Whether a failure was recorded.
    pub fn failed(&self) -> bool {
        self.lock().failure.is_some()
    }

    /// Peer `rank` left (`why`, in words after "rank N"; `lost`: its
    /// connection broke); `culprit` is the rank to blame should that make
    /// us give up. The first word counts.
    pub fn peer_gone(&self, rank: usize, why: String, culprit: Option<usize>, lost: bool) {
        self.update(|state| {
            if state.gone.iter().all(|gone| gone.rank != rank) {
                state.gone.push(Departure {
                    rank,
                    since: Instant::now(),
                    why,
                    culprit,
                    lost,
                });
            }
        });
    }

    /// A handshake the listener refused (named if the higher ranks do not
    /// all connect in time).
    pub fn reject(&self, what: String) {
        // The first few name the problem; strangers hammering the port
        // must not grow the board.
        self.update(|state| {
            if state.rejected.len() < MAX_REJECTED {
                state.rejected.push(what);
            }
        });
    }

    /// Once this rank gives up: the rank it gives up over, if any
    /// (lock-free: handlers look on idle passes and before streaming).
    pub fn abort_requested(&self) -> Option<Option<usize>> {
        match self.abort.load(Ordering::Acquire) {
            NO_ABORT => None,
            OVER_NOBODY => Some(None),
            rank => Some(Some(rank)),
        }
    }

    /// A handler told its peer that we give up, or found it cannot.
    pub fn told(&self) {
        self.update(|state| state.told += 1);
    }

    /// This rank's row (a default cell where none was posted).
    pub fn row(&self) -> Vec<Cell> {
        let state = self.lock();
        state.cells.iter().map(|c| c.unwrap_or_default()).collect()
    }

    /// Rank 0: `cells[from][to]` of every rank, ours included.
    pub fn matrix(&self) -> Vec<Vec<Cell>> {
        let mut cells = vec![self.row()];
        let state = self.lock();
        for rank in 1..self.size {
            let mut row = state.rows[rank].clone().unwrap_or_default();
            row.resize(self.size, Cell::default());
            cells.push(row);
        }
        cells
    }

    /// Waits until this rank is done: every stream over and, on rank 0,
    /// every row in, or elsewhere our row delivered. On a failure (a
    /// handler's, a peer that left owing something for [`LAST_WORDS`],
    /// higher ranks that have not connected within `connect_timeout`, or
    /// what `healthy` reports) this rank gives up: its handlers stop
    /// streaming and tell their peers, and this returns the failure in
    /// words once they did (or after [`LAST_WORDS`]). `connected` is
    /// called once, when every peer has a session.
    pub fn supervise(
        &self,
        connect_timeout: Duration,
        healthy: impl Fn() -> Result<(), String>,
        connected: impl FnOnce(),
    ) -> Result<(), String> {
        let connect_by = Instant::now() + connect_timeout;
        let mut connected = Some(connected);
        let mut state = self.lock();
        let failure = loop {
            if let Some(connected) = connected.take_if(|_| state.claimed_all(self.me)) {
                // Not under the lock: a write to a pipe nobody reads
                // would stall every handler that updates the board.
                drop(state);
                connected();
                state = self.lock();
            }
            if state.failure.is_none() && state.finished(self.me) {
                return Ok(());
            }
            let late = match Instant::now() > connect_by {
                true => self.missing_higher(&state, connect_timeout),
                false => None,
            };
            let failure = state
                .failure
                .clone()
                .or_else(|| state.lost(self.me))
                .or(late);
            if let Some(failure) = failure.or_else(|| healthy().err().map(|what| (None, what))) {
                break failure;
            }
            state = self
                .changed
                .wait_timeout(state, LOOK)
                .unwrap_or_else(PoisonError::into_inner)
                .0;
        };
        drop(state);
        self.give_up(failure.0);
        Err(format!("rank {}: {}", self.me, failure.1))
    }

    /// The failure when higher ranks have not connected within
    /// `connect_timeout`, naming them; `None` if every one has. No rank
    /// is blamed: a rank may be missing because it is stuck connecting
    /// to another one.
    fn missing_higher(&self, state: &State, connect_timeout: Duration) -> Option<Failure> {
        let missing: Vec<String> = (self.me + 1..self.size)
            .filter(|&rank| !state.claimed[rank])
            .map(|rank| rank.to_string())
            .collect();
        if missing.is_empty() {
            return None;
        }
        let rejected = match state.rejected.is_empty() {
            true => String::new(),
            false => format!(" (rejected: {})", state.rejected.join("; ")),
        };
        let higher = self.size - 1 - self.me;
        let rank_or_ranks = if missing.len() == 1 { "rank" } else { "ranks" };
        let what = format!(
            "only {} of {higher} higher ranks connected within {}s, not {rank_or_ranks} {}{rejected}",
            higher - missing.len(),
            connect_timeout.as_secs(),
            missing.join(", ")
        );
        Some((None, what))
    }

    /// Has every handler tell its peer that this rank gives up over
    /// `culprit`, and waits until they did, at most [`LAST_WORDS`].
    fn give_up(&self, culprit: Option<usize>) {
        let code = culprit.map_or(OVER_NOBODY, |rank| rank.min(OVER_NOBODY - 1));
        self.abort.store(code, Ordering::Release);
        self.wake_reactors();
        let until = Instant::now() + LAST_WORDS;
        let mut state = self.lock();
        while state.told < state.claimed.iter().filter(|c| **c).count() {
            let left = until.saturating_duration_since(Instant::now());
            if left.is_zero() {
                break;
            }
            state = self
                .changed
                .wait_timeout(state, left)
                .unwrap_or_else(PoisonError::into_inner)
                .0;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cell(bytes: u64) -> Cell {
        Cell {
            bytes,
            ..Cell::default()
        }
    }

    #[test]
    fn a_rank_is_done_once_its_row_is_complete_and_delivered() {
        let board = Board::new(1, 3);
        board.claim(0).unwrap();
        board.claim(2).unwrap();
        assert!(board.claim(2).unwrap_err().contains("rank 2"));
        assert!(board.claim(1).is_err(), "a rank is no peer of its own");
        assert!(board.claim(3).is_err());
        board.post_cell(0, cell(10));
        assert!(!board.row_ready());
        board.post_cell(2, cell(12));
        board.post_cell(2, cell(12));
        assert!(board.row_ready());
        let mut out = vec![0; 3 * CELL_BYTES];
        board.fill_row(&mut out);
        let row: Vec<Cell> = out.chunks_exact(CELL_BYTES).map(Cell::decode).collect();
        assert_eq!(row, vec![cell(10), Cell::default(), cell(12)]);
        board.row_delivered();
        assert_eq!(
            board.supervise(Duration::from_secs(1), || Ok(()), || {}),
            Ok(())
        );
        assert_eq!(board.abort_requested(), None);
    }

    #[test]
    fn rank_0_waits_for_every_row_and_builds_the_matrix() {
        let board = Board::new(0, 2);
        board.claim(1).unwrap();
        board.post_cell(1, cell(1));
        assert!(!board.lock().finished(0));
        board.post_row(1, vec![cell(2)]);
        assert_eq!(
            board.supervise(Duration::from_secs(1), || Ok(()), || {}),
            Ok(())
        );
        assert_eq!(
            board.matrix(),
            vec![
                vec![Cell::default(), cell(1)],
                vec![cell(2), Cell::default()]
            ]
        );
    }

    #[test]
    fn every_peer_that_left_owing_something_is_named_a_lost_one_blamed() {
        let board = Board::new(1, 3);
        board.claim(0).unwrap();
        board.claim(2).unwrap();
        board.peer_gone(0, "hung up early".into(), Some(0), false);
        board.peer_gone(2, "was lost: reset".into(), Some(2), true);
        assert_eq!(board.lock().lost(1), None, "not before LAST_WORDS");
        std::thread::sleep(LAST_WORDS + Duration::from_millis(10));
        assert_eq!(
            board.lock().lost(1),
            Some((
                Some(2),
                "rank 0 hung up early; rank 2 was lost: reset".to_string()
            ))
        );
    }

    #[test]
    fn a_peer_that_leaves_owing_something_is_named_and_everyone_told() {
        let board = std::sync::Arc::new(Board::new(0, 3));
        board.claim(1).unwrap();
        board.claim(2).unwrap();
        // Rank 1 is done with us; rank 2 leaves mid-stream.
        board.post_cell(1, cell(1));
        board.post_row(1, vec![cell(2); 3]);
        board.peer_gone(1, "hung up early".into(), Some(1), false);
        board.peer_gone(2, "was lost: reset".into(), Some(2), true);
        board.peer_gone(2, "hung up early".into(), Some(2), false);
        let teller = {
            let board = std::sync::Arc::clone(&board);
            std::thread::spawn(move || {
                while board.abort_requested().is_none() {
                    std::thread::sleep(Duration::from_millis(5));
                }
                board.told();
                board.told();
                board.abort_requested()
            })
        };
        let started = Instant::now();
        let mut connected = 0;
        let outcome = board.supervise(Duration::from_secs(5), || Ok(()), || connected += 1);
        assert_eq!(connected, 1, "told once that every peer connected");
        assert_eq!(outcome, Err("rank 0: rank 2 was lost: reset".to_string()));
        assert!(started.elapsed() >= LAST_WORDS);
        assert_eq!(teller.join().unwrap(), Some(Some(2)));
    }

    #[test]
    fn the_first_failure_counts_and_missing_ranks_are_counted() {
        let board = Board::new(0, 2);
        board.reject("10.0.0.9:5: bad key".into());
        let outcome = board.supervise(Duration::ZERO, || Ok(()), || {});
        assert_eq!(
            outcome,
            Err("rank 0: only 0 of 1 higher ranks connected within 0s, not rank 1 (rejected: 10.0.0.9:5: bad key)".into())
        );
        assert_eq!(board.abort_requested(), Some(None), "no rank is blamed");
        let board = Board::new(0, 4);
        board.claim(2).unwrap();
        let outcome = board.supervise(Duration::ZERO, || Ok(()), || panic!("not all connected"));
        assert_eq!(
            outcome,
            Err("rank 0: only 1 of 3 higher ranks connected within 0s, not ranks 1, 3".into())
        );
        assert_eq!(board.abort_requested(), Some(None));
        let board = Board::new(1, 2);
        board.fail(Some(0), "first".into());
        board.fail(None, "second".into());
        assert!(board.failed());
        assert_eq!(
            board.supervise(Duration::from_secs(1), || Ok(()), || {}),
            Err("rank 1: first".into())
        );
        assert_eq!(board.abort_requested(), Some(Some(0)));
        let board = Board::new(1, 2);
        let outcome = board.supervise(
            Duration::from_secs(1),
            || Err("reactor 0 stopped".into()),
            || {},
        );
        assert_eq!(outcome, Err("rank 1: reactor 0 stopped".into()));
    }
}
