//! Cross-thread submission: a bounded single-producer, single-consumer ring
//! of fixed-size commands from one application thread to one reactor.
//!
//! The producer ([`Submitter`]) writes a 64-byte command (the connection,
//! an optional immediate, and the payload inline or in the entry's own
//! payload slot) and publishes it with one release store of its tail
//! index; the reactor reads commands in order and stages them in the same
//! pass as its handlers' work, so they share its doorbells. Head and tail
//! live on cache lines of their own ([`CachePadded`]); each side caches the
//! other's index and reads it again only when the ring looks full (or
//! empty). A full ring is an immediate [`SubmitError::WouldBlock`]: nothing
//! blocks, locks or allocates on either side.

use std::cell::UnsafeCell;
use std::fmt;
use std::mem::MaybeUninit;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};

use crossbeam_utils::CachePadded;

use super::port::Port;
use crate::clock::Clock;
use crate::reactor::ConnId;

/// Payload bytes that travel inside the command itself; longer payloads go
/// in the entry's payload slot (see [`RuntimeConfig::submit_slot_size`](super::RuntimeConfig::submit_slot_size)).
pub const INLINE_PAYLOAD: usize = 36;

/// The payload is in the entry's slot, not inline.
const IN_SLOT: u32 = 1;
/// The command carries an immediate.
const HAS_IMM: u32 = 2;

/// One command: exactly a cache line.
#[derive(Clone, Copy)]
#[repr(C, align(64))]
pub(crate) struct Command {
    pub(crate) conn: ConnId,
    imm: u32,
    flags: u32,
    len: u32,
    inline: [u8; INLINE_PAYLOAD],
}

const _: () = assert!(size_of::<Command>() == 64);

impl Command {
    /// The immediate to send with the payload.
    pub(crate) fn imm(&self) -> Option<u32> {
        (self.flags & HAS_IMM != 0).then_some(self.imm)
    }
}

/// Why a command was not queued.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SubmitError {
    /// The ring is full: the reactor has not caught up (or the connection
    /// has no credit). Try again later; nothing was queued.
    #[error("the submission ring is full")]
    WouldBlock,
    /// The payload is longer than an entry can carry.
    #[error("payload of {len} bytes exceeds the submission ring's maximum of {max}")]
    TooLarge {
        /// Requested length.
        len: usize,
        /// The largest payload the ring takes.
        max: usize,
    },
    /// The reactor has stopped.
    #[error("the reactor has stopped")]
    Stopped,
}

/// The ring both ends share.
pub(crate) struct Ring {
    /// Next entry the reactor reads (written by the reactor only).
    head: CachePadded<AtomicUsize>,
    /// Next entry the producer writes (written by the producer only).
    tail: CachePadded<AtomicUsize>,
    /// The producer is gone: the reactor drops the ring once it is empty.
    closed: AtomicBool,
    /// Commands the reactor took but could not stage (closed connection,
    /// payload too large for the connection).
    rejected: AtomicU64,
    mask: usize,
    commands: Box<[UnsafeCell<MaybeUninit<Command>>]>,
    slot_size: usize,
    slots: Box<[UnsafeCell<u8>]>,
    /// When each entry was queued (TSC ticks), with submission tracing on;
    /// empty otherwise. Written before the tail's release store and read
    /// after its acquire load, like the commands.
    stamps: Box<[AtomicU64]>,
    /// The clock of the stamps, with tracing on.
    clock: Option<Clock>,
}

// SAFETY: one producer and one consumer. An entry is written only by the
// producer, and only while it lies between the consumer's head and the
// producer's tail + capacity (not yet published); it is read only by the
// consumer after the producer published it with a release store of the tail
// (acquired by the consumer), and the producer reuses it only after the
// consumer's release store of the head (acquired by the producer) says it
// is done. The indices themselves are atomics.
unsafe impl Sync for Ring {}
// SAFETY: the ring owns plain bytes, atomics and a `Clock` (Send and Sync,
// asserted below); see Sync for the sharing.
unsafe impl Send for Ring {}

const _: () = {
    const fn send_and_sync<T: Send + Sync>() {}
    send_and_sync::<Clock>();
};

impl fmt::Debug for Ring {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Ring")
            .field("capacity", &self.commands.len())
            .field("slot_size", &self.slot_size)
            .finish_non_exhaustive()
    }
}

/// Makes a ring of `capacity` commands (rounded up to a power of two),
/// each with a payload slot of `slot_size` bytes (0: inline payloads only);
/// with `clock`, each command is stamped when queued.
pub(crate) fn ring(
    capacity: usize,
    slot_size: usize,
    clock: Option<Clock>,
) -> (Producer, Consumer) {
    let capacity = capacity.max(2).next_power_of_two();
    let ring = Arc::new(Ring {
        head: CachePadded::new(AtomicUsize::new(0)),
        tail: CachePadded::new(AtomicUsize::new(0)),
        closed: AtomicBool::new(false),
        rejected: AtomicU64::new(0),
        mask: capacity - 1,
        commands: (0..capacity)
            .map(|_| UnsafeCell::new(MaybeUninit::uninit()))
            .collect(),
        slot_size,
        slots: (0..capacity * slot_size)
            .map(|_| UnsafeCell::new(0))
            .collect(),
        stamps: (0..if clock.is_some() { capacity } else { 0 })
            .map(|_| AtomicU64::new(0))
            .collect(),
        clock,
    });
    (
        Producer {
            ring: Arc::clone(&ring),
            tail: 0,
            head_seen: 0,
        },
        Consumer {
            ring,
            head: 0,
            tail_seen: 0,
        },
    )
}

impl Ring {
    /// Entry `index`'s payload slot.
    fn slot_ptr(&self, index: usize) -> *mut u8 {
        UnsafeCell::raw_get(self.slots.as_ptr().wrapping_add(index * self.slot_size))
    }
}

/// The application's end of a ring.
pub(crate) struct Producer {
    ring: Arc<Ring>,
    /// Next entry to write (a private copy of the ring's tail).
    tail: usize,
    /// The consumer's head as last read.
    head_seen: usize,
}

impl fmt::Debug for Producer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Producer")
            .field("ring", &self.ring)
            .field("queued", &self.queued())
            .finish()
    }
}

impl Producer {
    /// Commands queued and not yet taken by the reactor.
    pub(crate) fn queued(&self) -> usize {
        self.tail - self.ring.head.load(Ordering::Acquire)
    }

    /// Entries in the ring.
    pub(crate) fn capacity(&self) -> usize {
        self.ring.commands.len()
    }

    /// The longest payload a command can carry.
    pub(crate) fn max_payload(&self) -> usize {
        self.ring.slot_size.max(INLINE_PAYLOAD)
    }

    /// Commands the reactor could not stage.
    pub(crate) fn rejected(&self) -> u64 {
        self.ring.rejected.load(Ordering::Relaxed)
    }

    /// Queues a SEND of `len` bytes that `fill` writes in place (inline or
    /// in the entry's slot), then publishes it.
    #[inline]
    pub(crate) fn push(
        &mut self,
        conn: ConnId,
        len: usize,
        imm: Option<u32>,
        fill: impl FnOnce(&mut [u8]),
    ) -> Result<(), SubmitError> {
        if len > self.max_payload() {
            return Err(SubmitError::TooLarge {
                len,
                max: self.max_payload(),
            });
        }
        let capacity = self.ring.commands.len();
        if self.tail - self.head_seen == capacity {
            self.head_seen = self.ring.head.load(Ordering::Acquire);
            if self.tail - self.head_seen == capacity {
                return Err(SubmitError::WouldBlock);
            }
        }
        let index = self.tail & self.ring.mask;
        let mut command = Command {
            conn,
            imm: imm.unwrap_or(0),
            flags: if imm.is_some() { HAS_IMM } else { 0 },
            len: len as u32,
            inline: [0; INLINE_PAYLOAD],
        };
        if len <= INLINE_PAYLOAD {
            fill(&mut command.inline[..len]);
        } else {
            command.flags |= IN_SLOT;
            // SAFETY: entry `index` is free (checked above: the consumer's
            // head has passed it), so the consumer does not read its slot
            // and we are the only producer; the slot lies inside `slots`
            // (`len <= slot_size` since len > INLINE_PAYLOAD).
            let slot = unsafe { std::slice::from_raw_parts_mut(self.ring.slot_ptr(index), len) };
            fill(slot);
        }
        // SAFETY: as above, the entry is ours until the tail store below
        // publishes it.
        unsafe { (*self.ring.commands[index].get()).write(command) };
        if let Some(clock) = &self.ring.clock {
            self.ring.stamps[index].store(clock.now(), Ordering::Relaxed);
        }
        self.tail += 1;
        self.ring.tail.store(self.tail, Ordering::Release);
        Ok(())
    }
}

impl Drop for Producer {
    fn drop(&mut self) {
        self.ring.closed.store(true, Ordering::Release);
    }
}

/// The reactor's end of a ring.
pub(crate) struct Consumer {
    ring: Arc<Ring>,
    /// Next entry to read (a private copy of the ring's head).
    head: usize,
    /// The producer's tail as last read.
    tail_seen: usize,
}

impl fmt::Debug for Consumer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Consumer")
            .field("ring", &self.ring)
            .field("head", &self.head)
            .finish()
    }
}

impl Consumer {
    /// The oldest command not yet taken, and its payload. It stays in the
    /// ring until [`pop`](Self::pop).
    #[inline]
    pub(crate) fn peek(&mut self) -> Option<(Command, &[u8])> {
        if self.head == self.tail_seen {
            self.tail_seen = self.ring.tail.load(Ordering::Acquire);
            if self.head == self.tail_seen {
                return None;
            }
        }
        let index = self.head & self.ring.mask;
        // SAFETY: the producer published entry `index` (the acquire load of
        // the tail above, or an earlier one, saw it) and does not touch it
        // until our head passes it.
        let command = unsafe { (*self.ring.commands[index].get()).assume_init() };
        let len = command.len as usize;
        let payload = if command.flags & IN_SLOT != 0 {
            // SAFETY: as above; the producer wrote `len <= slot_size` bytes
            // of the slot before publishing the entry, and leaves them alone
            // until `pop`, which needs `&mut self` (ending this borrow).
            unsafe { std::slice::from_raw_parts(self.ring.slot_ptr(index), len) }
        } else {
            // A copy of the command is returned, so its inline bytes are
            // read from the entry itself, which stays put until `pop`.
            // SAFETY: as above.
            let entry = unsafe { (*self.ring.commands[index].get()).assume_init_ref() };
            &entry.inline[..len]
        };
        Some((command, payload))
    }

    /// When the oldest command was queued (TSC ticks of the ring's clock),
    /// if the ring stamps its commands.
    #[inline]
    pub(crate) fn stamp(&self) -> Option<u64> {
        self.ring
            .stamps
            .get(self.head & self.ring.mask)
            .map(|stamp| stamp.load(Ordering::Relaxed))
    }

    /// Frees the oldest command's entry for the producer.
    #[inline]
    pub(crate) fn pop(&mut self, staged: bool) {
        if !staged {
            self.ring.rejected.fetch_add(1, Ordering::Relaxed);
        }
        self.head += 1;
        self.ring.head.store(self.head, Ordering::Release);
    }

    /// The oldest command cannot be staged yet (its connection has no
    /// room): every command queued so far counts as looked at, so
    /// [`has_news`](Self::has_news) reports only newer ones. The blocked
    /// command waits for a completion or a credit update, which wakes the
    /// reactor anyway; without this, a command queued behind it would keep
    /// a sleeping reactor from ever sleeping.
    #[inline]
    pub(crate) fn noted(&mut self) {
        self.tail_seen = self.ring.tail.load(Ordering::Acquire);
    }

    /// Whether commands arrived that this end has not looked at yet (the
    /// reactor then does not sleep). Commands it looked at and could not
    /// stage yet wait for a completion, which wakes it anyway.
    #[inline]
    pub(crate) fn has_news(&self) -> bool {
        self.ring.tail.load(Ordering::Acquire) != self.tail_seen
    }

    /// The producer is gone and every command it queued was taken.
    pub(crate) fn is_finished(&self) -> bool {
        self.ring.closed.load(Ordering::Acquire)
            && self.ring.tail.load(Ordering::Acquire) == self.head
    }
}

/// An application thread's way to one reactor: a bounded ring of fixed-size
/// SEND commands (a payload inline in the command, or in the entry's slot
/// that [`send_with`](Self::send_with) fills in place). The reactor stages
/// them, in order, in the same pass as its handlers' work. A full ring is an
/// immediate [`SubmitError::WouldBlock`]; nothing blocks, locks or allocates
/// on either side. One thread owns it (`&mut self`); open one per thread.
///
/// Commands leave in the order they were queued, across connections too:
/// a connection without send credit holds the commands queued behind it
/// until a completion or a credit update makes room (or the connection
/// fails, and its commands are [`rejected`](Self::rejected)). The ring is
/// bounded, so the producer sees `WouldBlock`, never unbounded growth.
/// Give connections that must not wait for each other a ring each (a
/// thread may open several to one reactor).
pub struct Submitter {
    producer: Producer,
    port: Arc<Port>,
}

impl fmt::Debug for Submitter {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Submitter")
            .field("reactor", &self.port.index)
            .field("ring", &self.producer)
            .finish()
    }
}

impl Submitter {
    /// An application's end of a ring that reactor `port` drains.
    pub(super) fn new(producer: Producer, port: Arc<Port>) -> Self {
        Self { producer, port }
    }

    /// Queues a SEND of `data` with an optional immediate on `conn` (a
    /// connection of this submitter's reactor).
    ///
    /// # Errors
    /// [`SubmitError::WouldBlock`] when the ring is full,
    /// [`SubmitError::TooLarge`] beyond [`max_payload`](Self::max_payload),
    /// [`SubmitError::Stopped`] once the reactor has stopped.
    #[inline]
    pub fn send(&mut self, conn: ConnId, data: &[u8], imm: Option<u32>) -> Result<(), SubmitError> {
        self.send_with(conn, data.len(), imm, |buf| buf.copy_from_slice(data))
    }

    /// Queues a SEND of `len` bytes that `fill` writes straight into the
    /// ring entry.
    ///
    /// # Errors
    /// As [`send`](Self::send).
    #[inline]
    pub fn send_with(
        &mut self,
        conn: ConnId,
        len: usize,
        imm: Option<u32>,
        fill: impl FnOnce(&mut [u8]),
    ) -> Result<(), SubmitError> {
        if !self.port.is_open() {
            return Err(SubmitError::Stopped);
        }
        self.producer.push(conn, len, imm, fill)?;
        self.port.nudge();
        Ok(())
    }

    /// The reactor this ring feeds.
    pub fn reactor(&self) -> usize {
        self.port.index
    }

    /// Commands queued and not yet taken by the reactor.
    pub fn queued(&self) -> usize {
        self.producer.queued()
    }

    /// Commands the ring holds at most.
    pub fn capacity(&self) -> usize {
        self.producer.capacity()
    }

    /// The longest payload one command carries.
    pub fn max_payload(&self) -> usize {
        self.producer.max_payload()
    }

    /// Commands the reactor took but could not stage: a connection that is
    /// closed or not its own, or a payload too large for the connection.
    pub fn rejected(&self) -> u64 {
        self.producer.rejected()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::reactor::slab_key_for_tests;

    fn conn(n: u32) -> ConnId {
        slab_key_for_tests(n)
    }

    #[test]
    fn commands_arrive_in_order_inline_or_in_their_slot() {
        let (mut tx, mut rx) = ring(4, 256, None);
        tx.push(conn(1), 3, Some(7), |b| b.copy_from_slice(b"abc"))
            .unwrap();
        tx.push(conn(2), 100, None, |b| b.fill(9)).unwrap();
        let (command, payload) = rx.peek().unwrap();
        assert_eq!(
            (command.conn, command.imm(), payload),
            (conn(1), Some(7), &b"abc"[..])
        );
        rx.pop(true);
        let (command, payload) = rx.peek().unwrap();
        assert_eq!(
            (command.conn, command.imm(), payload.len()),
            (conn(2), None, 100)
        );
        assert!(payload.iter().all(|&b| b == 9));
        rx.pop(false);
        assert!(rx.peek().is_none());
        assert_eq!(tx.rejected(), 1);
    }

    #[test]
    fn a_full_ring_is_an_immediate_would_block_and_frees_up() {
        let (mut tx, mut rx) = ring(2, 0, None);
        tx.push(conn(1), 1, None, |b| b[0] = 1).unwrap();
        tx.push(conn(1), 1, None, |b| b[0] = 2).unwrap();
        assert_eq!(
            tx.push(conn(1), 1, None, |_| {}),
            Err(SubmitError::WouldBlock)
        );
        assert_eq!(
            tx.push(conn(1), INLINE_PAYLOAD + 1, None, |_| {}),
            Err(SubmitError::TooLarge {
                len: INLINE_PAYLOAD + 1,
                max: INLINE_PAYLOAD
            })
        );
        assert!(rx.has_news());
        rx.peek().unwrap();
        assert!(!rx.has_news(), "looked at");
        rx.pop(true);
        tx.push(conn(1), 1, None, |b| b[0] = 3).unwrap();
        assert!(rx.has_news());
        assert_eq!(rx.peek().unwrap().1, &[2]);
        rx.pop(true);
        assert_eq!(rx.peek().unwrap().1, &[3]);
        rx.pop(true);
        assert!(!rx.is_finished());
        drop(tx);
        assert!(rx.is_finished());
    }

    #[test]
    fn a_blocked_command_with_more_behind_it_is_not_news_forever() {
        let (mut tx, mut rx) = ring(4, 0, None);
        tx.push(conn(1), 1, None, |b| b[0] = 1).unwrap();
        rx.peek().unwrap();
        tx.push(conn(1), 1, None, |b| b[0] = 2).unwrap();
        assert!(rx.has_news());
        // The first cannot be staged: the reactor notes what it has seen.
        rx.peek().unwrap();
        rx.noted();
        assert!(!rx.has_news(), "a reactor may sleep until the credit comes");
        tx.push(conn(1), 1, None, |b| b[0] = 3).unwrap();
        assert!(rx.has_news(), "a newer command still counts");
        for expected in 1..=3 {
            assert_eq!(rx.peek().unwrap().1, &[expected]);
            rx.pop(true);
        }
    }

    #[test]
    fn two_threads_pass_a_million_commands_intact() {
        const N: u32 = 1_000_000;
        let (mut tx, mut rx) = ring(64, 128, None);
        let producer = std::thread::spawn(move || {
            for i in 0..N {
                let len = 1 + (i as usize % 120);
                loop {
                    match tx.push(conn(i), len, Some(i), |b| b.fill(i as u8)) {
                        Ok(()) => break,
                        Err(SubmitError::WouldBlock) => std::hint::spin_loop(),
                        Err(err) => panic!("{err}"),
                    }
                }
            }
        });
        let mut next = 0;
        while next < N {
            let Some((command, payload)) = rx.peek() else {
                std::hint::spin_loop();
                continue;
            };
            assert_eq!(command.conn, conn(next));
            assert_eq!(command.imm(), Some(next));
            assert_eq!(payload.len(), 1 + (next as usize % 120));
            assert!(payload.iter().all(|&b| b == next as u8), "command {next}");
            rx.pop(true);
            next += 1;
        }
        producer.join().unwrap();
        assert!(rx.is_finished());
    }
}
