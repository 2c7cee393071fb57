//! The reactor's connections, addressed by the ids their work requests
//! carry: the slab of connections and the `wr_id` layout ([`wr_id`]), with
//! the one [`lookup`](ConnTable::lookup) that takes a completion's `wr_id`
//! and QP number to a vetted connection, or refuses it, saying why.
//!
//! A completion is the connection's only if every check holds: a
//! connection lives at the index its `wr_id` names, of the generation it
//! names (a removed connection's id never reaches the newcomer in its
//! entry), on the QP the completion came from (a stranger's request
//! naming our index is not ours), and of a kind the connection posts (a
//! receive into a posted slot of its own ring, a send-queue request, or a
//! direct connection's). A receive of the SRQ is the connection's whose QP
//! consumed it, once the SRQ pool recognises the exact `wr_id` it posted.
//! The whole lookup is one slab access.
//!
//! The layout itself is a leaf: connections encode their tags with it and
//! the SRQ pool its slots' ids; only this table decodes them.

pub(crate) mod wr_id;

#[cfg(test)]
mod tests;

use std::collections::TryReserveError;

use super::ConnId;
use super::conn::Conn;
use super::slab::{Key, ROOM, Slab};
use super::srq_pool::SrqPool;
use wr_id::{MAX_CONNS, WrKind};

/// The connections of one reactor.
pub(crate) struct ConnTable {
    slab: Slab<Conn>,
    /// The first connection a pass's completions left work for the flush
    /// (see [`settle`](Self::settle)): flushed right after them, without
    /// a walk of the touched list.
    due: Option<u32>,
}

/// What a vetted completion is to its connection.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Completed {
    /// A receive into slot `slot` (of the connection's own ring, marked
    /// consumed by the lookup, or of the SRQ, claimed from the pool).
    Recv { slot: u32 },
    /// Send-queue request `seq` (and every unsignaled one before it).
    Send { seq: u32 },
    /// A request of a direct connection's handler.
    Direct,
}

/// A completion's connection, vetted.
pub(crate) struct Entry<'a> {
    pub(crate) key: Key,
    pub(crate) completed: Completed,
    pub(crate) conn: &'a mut Conn,
}

/// Why a completion is none of a connection's.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Refusal {
    /// Nothing of this table posted it: no connection lives at the index it
    /// names, its kind is none the table writes, or it is an SRQ receive
    /// whose `wr_id` is not a posted slot's.
    Foreign,
    /// An SRQ receive that a QP the table does not serve consumed: its slot
    /// went straight back to the pool (which now has a repost to flush).
    Reclaimed,
    /// It names an earlier tenant of the connection's entry.
    StaleGeneration,
    /// It came from another QP than the connection's.
    WrongQp,
    /// The connection posts no request of that kind: a receive of its own
    /// ring on a connection that receives from the SRQ, a direct request on
    /// a connection of the reactor's protocol or the other way round.
    WrongKind,
    /// A receive into a slot of the connection's own ring that is not
    /// posted: none the device can have filled through it.
    NotPosted,
    /// Not a direct connection's id, asked of a lookup for direct ones
    /// only (a lean pass's): the caller looks it up in full, apart.
    NotDirect,
}

impl ConnTable {
    /// An empty table whose ids name `owner` (a reactor's unique id), with
    /// room for `reserve` connections reserved.
    ///
    /// Quarantined: completions of a removed connection's QP may still be
    /// queued, naming its index; a pass that drained every CQ after the
    /// removal releases it. Indexed below `MAX_CONNS`, as a `wr_id`
    /// carries the index: an entry retired after 2^32 tenants takes one
    /// index of that space for good.
    pub(crate) fn new(owner: u64, reserve: usize) -> Result<Self, TryReserveError> {
        let slab = Slab::new(MAX_CONNS, owner)
            .indexed_below(MAX_CONNS as u32)
            .quarantining()
            .tracking()
            .reserving(reserve)?;
        Ok(Self { slab, due: None })
    }

    /// Whose completion `wr_id` of QP `qpn` is: its connection, or why it
    /// is none. Nothing is listed for the flush: the caller
    /// [settles](Self::settle) the connection once it knows what the
    /// completion left it. With `DIRECT_ONLY`, ids of anything but a
    /// direct connection are refused as [`Refusal::NotDirect`] after one
    /// mask and compare.
    #[inline(always)]
    pub(crate) fn lookup<const DIRECT_ONLY: bool>(
        &mut self,
        wr_id: u64,
        qpn: u32,
        srq: &mut Option<SrqPool>,
    ) -> Result<Entry<'_>, Refusal> {
        if DIRECT_ONLY {
            let Some((index, generation)) = wr_id::decode_direct(wr_id) else {
                return Err(Refusal::NotDirect);
            };
            return self.vet_direct(index, generation, qpn);
        }
        let (index, generation, kind) = wr_id::decode(wr_id);
        if wr_id::is_direct(wr_id, kind) {
            return self.vet_direct(index, generation, qpn);
        }
        let completed = match kind {
            WrKind::Recv { slot } => Completed::Recv { slot },
            WrKind::Send { seq } => Completed::Send { seq },
            WrKind::SrqRecv => return self.vet_srq(wr_id, qpn, srq),
            WrKind::Unknown => return Err(Refusal::Foreign),
        };
        // A receive into a slot of the connection's own ring that is not
        // posted (or not any more) is none the device can have filled
        // through it: a stranger's too, refused before a byte of the slot
        // is read or the slot goes back. (Checked last, as it marks a
        // posted slot consumed.)
        let vet = |key: Key, conn: &mut Conn| {
            if !wr_id::same_generation(key, generation) {
                return Err(Refusal::StaleGeneration);
            }
            // Only a direct connection's handler posts on its QP, and
            // `DirectQp` sets the direct bit in every request: a protocol
            // id from a direct QP is none of ours (the device's data, so
            // refused, never asserted), and a direct connection has no
            // protocol QP number.
            if conn.protocol_qpn() != u64::from(qpn) {
                return Err(if conn.is_direct() && conn.qpn() == qpn {
                    Refusal::WrongKind
                } else {
                    Refusal::WrongQp
                });
            }
            match completed {
                Completed::Recv { slot } => {
                    if conn.rq().uses_srq() {
                        return Err(Refusal::WrongKind);
                    }
                    if !conn.rq_mut().consume(slot) {
                        return Err(Refusal::NotPosted);
                    }
                    Ok(())
                }
                _ => Ok(()),
            }
        };
        let (key, conn) = self.slab.get_by_index_if(index, Refusal::Foreign, vet)?;
        Ok(Entry {
            key,
            completed,
            conn,
        })
    }

    /// A direct connection's completion: its connection.
    #[inline(always)]
    fn vet_direct(&mut self, index: u32, generation: u32, qpn: u32) -> Result<Entry<'_>, Refusal> {
        let vet = |key: Key, conn: &mut Conn| {
            if !wr_id::same_generation(key, generation) {
                Err(Refusal::StaleGeneration)
            } else if conn.qpn() != qpn {
                Err(Refusal::WrongQp)
            } else if !conn.is_direct() {
                Err(Refusal::WrongKind)
            } else {
                Ok(())
            }
        };
        let (key, conn) = self.slab.get_by_index_if(index, Refusal::Foreign, vet)?;
        Ok(Entry {
            key,
            completed: Completed::Direct,
            conn,
        })
    }

    /// An SRQ receive's completion (it comes with exactly the tagged
    /// `wr_id` the slot was posted with): the QP number says which
    /// connection consumed the slot.
    #[inline]
    fn vet_srq(
        &mut self,
        wr_id: u64,
        qpn: u32,
        srq: &mut Option<SrqPool>,
    ) -> Result<Entry<'_>, Refusal> {
        let Some(pool) = srq.as_mut() else {
            return Err(Refusal::Foreign);
        };
        let Some(slot) = pool.claim(wr_id) else {
            return Err(Refusal::Foreign);
        };
        // The owner table names no live connection (never: a connection
        // leaves it as it goes): the slot goes back as for a QP the table
        // does not serve.
        let Some((key, conn)) = pool
            .owner(qpn)
            .and_then(|key| Some((key, self.slab.get_mut_quiet(key)?)))
        else {
            pool.reclaim(slot);
            return Err(Refusal::Reclaimed);
        };
        conn.rq_mut().note_shared_receive();
        Ok(Entry {
            key,
            completed: Completed::Recv { slot },
            conn,
        })
    }

    /// Whether `wr_id`, which [`lookup`](Self::lookup) refused, is a request
    /// or receive of a connection removed since it posted it: its entry is
    /// still in quarantine (until a pass has polled every CQ empty after
    /// the removal, the only time such completions can be about) and the
    /// id carries that connection's generation. A late completion of the
    /// reactor's own, not a stranger's. Ids of no connection's kind (an
    /// SRQ receive's, a window bind's) are never departed.
    pub(crate) fn names_departed(&self, wr_id: u64) -> bool {
        let (index, generation, kind) = wr_id::decode(wr_id);
        matches!(kind, WrKind::Recv { .. } | WrKind::Send { .. })
            && self
                .slab
                .quarantined_generation(index)
                .is_some_and(|departed| {
                    let key = Key {
                        index,
                        generation: departed,
                        owner: self.owner(),
                    };
                    wr_id::same_generation(key, generation)
                })
    }

    /// The id the next [`insert`](Self::insert) gives, or `None` when the
    /// table is full.
    pub(crate) fn vacant_id(&self) -> Option<ConnId> {
        self.slab.vacant_key().map(ConnId)
    }

    /// Stores `conn`, built with [`vacant_id`](Self::vacant_id)'s id.
    pub(crate) fn insert(&mut self, conn: Conn) {
        let key = self.slab.insert(conn);
        debug_assert!(key.is_some(), "a connection is built for a vacant id");
    }

    /// Takes connection `id` out; its entry waits in quarantine until
    /// [`release_quarantine`](Self::release_quarantine).
    pub(crate) fn remove(&mut self, id: ConnId) -> Option<Conn> {
        self.slab.remove(id.key())
    }

    /// Connection `index` waited for room and has it back: listed, for
    /// the walk that tells the handlers ([`ROOM`]).
    pub(crate) fn list_room(&mut self, index: u32) {
        self.slab.list_room(index);
    }

    /// Whether a connection is listed as having room back.
    #[inline(always)]
    pub(crate) fn has_room_news(&self) -> bool {
        self.slab.has_listed(ROOM)
    }

    /// The reactor whose connections these are (the owner every key
    /// names).
    #[inline]
    pub(crate) fn owner(&self) -> u64 {
        self.slab.owner()
    }

    /// Live connections.
    pub(crate) fn len(&self) -> usize {
        self.slab.len()
    }

    #[inline]
    pub(crate) fn get(&self, key: Key) -> Option<&Conn> {
        self.slab.get(key)
    }

    /// The connection, listed for the flush.
    #[inline]
    pub(crate) fn get_mut(&mut self, key: Key) -> Option<&mut Conn> {
        self.slab.get_mut(key)
    }

    /// The connection, not listed: for a change that leaves the flush
    /// nothing to do, or whose caller lists it.
    #[inline]
    pub(crate) fn get_mut_quiet(&mut self, key: Key) -> Option<&mut Conn> {
        self.slab.get_mut_quiet(key)
    }

    /// The connection at `index` with its key, not listed: for the flush
    /// that works the lists off.
    #[inline]
    pub(crate) fn get_by_index_quiet(&mut self, index: u32) -> Option<(Key, &mut Conn)> {
        self.slab.get_by_index_quiet(index)
    }

    pub(crate) fn iter(&self) -> impl Iterator<Item = (Key, &Conn)> {
        self.slab.iter()
    }

    /// Lists connection `index` for the next flush.
    #[inline]
    pub(crate) fn touch(&mut self, index: u32) {
        self.slab.touch(index);
    }

    /// A completion left connection `index` work for the flush: the first
    /// such connection of a pass is held as due, for the pass to flush
    /// right after its completions ([`take_due`](Self::take_due)); any
    /// other is listed for the flush's walk. A pass's completions are
    /// mostly one connection's, which then costs no walk.
    #[inline(always)]
    pub(crate) fn settle(&mut self, index: u32) {
        match self.due {
            None => self.due = Some(index),
            Some(due) if due == index => {}
            Some(_) => self.slab.touch(index),
        }
    }

    /// Whether connection `index` is due or listed for the flush (debug
    /// checks, tests).
    #[cfg(any(test, debug_assertions))]
    pub(crate) fn is_settled(&self, index: u32) -> bool {
        self.due == Some(index) || self.slab.is_listed(super::slab::TOUCHED, index)
    }

    /// Lists the connection held as due for the flush's walk instead: for
    /// a pass that will not flush it itself (a lean one), and for a walk
    /// after a pass a failed poll cut short.
    #[inline]
    pub(crate) fn list_due(&mut self) {
        if let Some(index) = self.due.take() {
            self.slab.touch(index);
        }
    }

    /// The connection held as due, taken.
    #[inline(always)]
    pub(crate) fn take_due(&mut self) -> Option<u32> {
        self.due.take()
    }

    /// Parks connection `index` for the idle-time flush.
    #[inline]
    pub(crate) fn park(&mut self, index: u32) {
        self.slab.park(index);
    }

    /// True if a connection is listed for the next flush.
    #[inline]
    pub(crate) fn has_touched(&self) -> bool {
        self.slab.has_touched()
    }

    /// See [`Slab::begin_walk`].
    #[inline]
    pub(crate) fn begin_walk(&mut self, list: usize) -> usize {
        self.slab.begin_walk(list)
    }

    /// See [`Slab::unlist_at`].
    #[inline]
    pub(crate) fn unlist_at(&mut self, list: usize, at: usize) -> Option<u32> {
        self.slab.unlist_at(list, at)
    }

    /// See [`Slab::end_walk`].
    #[inline]
    pub(crate) fn end_walk(&mut self, list: usize) {
        self.slab.end_walk(list);
    }

    /// Removed connections whose entries wait for the CQs to drain.
    #[inline]
    pub(crate) fn quarantined(&self) -> usize {
        self.slab.quarantined()
    }

    /// Lets the first `count` quarantined entries take newcomers: no
    /// completion naming them is left.
    pub(crate) fn release_quarantine(&mut self, count: usize) {
        self.slab.release_quarantine(count);
    }

    /// Whether entry `index` is on slab list `list`.
    #[cfg(test)]
    pub(crate) fn is_listed(&self, list: usize, index: u32) -> bool {
        self.slab.is_listed(list, index)
    }

    /// See [`Slab::age_vacant`].
    #[cfg(test)]
    pub(crate) fn age_vacant(&mut self, generation: u32) -> bool {
        self.slab.age_vacant(generation)
    }
}
