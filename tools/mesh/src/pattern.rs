//! The payload every message carries: a pattern unique to sender, receiver
//! and sequence number, filled before sending and checked on arrival, so
//! that any lost, misplaced, stale or foreign message fails the check.

/// The word at `index` of message `seq` from `from` to `to`.
#[inline]
pub fn pattern_word(from: usize, to: usize, seq: u64, index: usize) -> u64 {
    let key = (seq << 24) ^ ((from as u64) << 12) ^ to as u64;
    key.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ (index as u64).wrapping_mul(0xbf58_476d_1ce4_e5b9)
}

/// Fills `buf` with message `seq` from `from` to `to`.
pub fn fill_pattern(buf: &mut [u8], from: usize, to: usize, seq: u64) {
    for (index, chunk) in buf.chunks_mut(8).enumerate() {
        let word = pattern_word(from, to, seq, index).to_le_bytes();
        chunk.copy_from_slice(&word[..chunk.len()]);
    }
}

/// Whether `buf` is exactly message `seq` from `from` to `to`.
pub fn pattern_matches(buf: &[u8], from: usize, to: usize, seq: u64) -> bool {
    buf.chunks(8).enumerate().all(|(index, chunk)| {
        chunk == &pattern_word(from, to, seq, index).to_le_bytes()[..chunk.len()]
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_message_matches_only_its_own_sender_receiver_and_number() {
        let mut buf = vec![0; 77];
        fill_pattern(&mut buf, 1, 2, 5);
        assert!(pattern_matches(&buf, 1, 2, 5));
        assert!(!pattern_matches(&buf, 2, 1, 5));
        assert!(!pattern_matches(&buf, 1, 3, 5));
        assert!(!pattern_matches(&buf, 1, 2, 6));
        buf[76] ^= 1;
        assert!(!pattern_matches(&buf, 1, 2, 5));
    }
}
