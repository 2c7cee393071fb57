//! What travels between ranks besides the data: the kind of each SEND in
//! its immediate, and the figures each rank reports to rank 0.

/// Immediate of a SEND: its kind in the top byte, a 24-bit number below.
pub fn tagged(kind: u32, low: u64) -> u32 {
    (kind << 24) | (low as u32 & 0x00ff_ffff)
}

/// The kind and the 24-bit number of a SEND's immediate.
pub fn untagged(imm: u32) -> (u32, u64) {
    (imm >> 24, u64::from(imm & 0x00ff_ffff))
}

/// A latency probe (8 bytes), numbered.
pub const PING: u32 = 1;
/// The answer to a [`PING`].
pub const PONG: u32 = 2;
/// The sender has taken all its latency samples.
pub const LATENCY_DONE: u32 = 3;
/// A stream message (SEND streams; WRITE streams carry the sequence
/// number as the whole immediate).
pub const DATA: u32 = 4;
/// The end of a stream: its message count as 8 little-endian bytes.
pub const END: u32 = 5;
/// A rank's row of [`Cell`]s, for rank 0.
pub const RESULT: u32 = 6;
/// The sender gives up: its run failed over the rank in the number
/// ([`NOBODY`] when no rank is to blame), and it is about to leave.
pub const ABORT: u32 = 7;
/// The number of an [`ABORT`] that names no rank.
pub const NOBODY: u64 = 0x00ff_ffff;

/// One rank's figures towards one peer, as sent to rank 0.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Cell {
    /// Median half round trip of the latency ping-pongs.
    pub latency_ns: u64,
    /// Bytes the stream to the peer carried.
    pub bytes: u64,
    /// How long that stream took, up to the completion of its end.
    pub elapsed_ns: u64,
    /// Messages from the peer that arrived corrupted, misplaced or out of order.
    pub bad: u64,
}

/// Bytes of one encoded [`Cell`].
pub const CELL_BYTES: usize = 32;

impl Cell {
    /// Writes the cell into `out` (at least [`CELL_BYTES`] long).
    pub fn encode(&self, out: &mut [u8]) {
        for (chunk, value) in
            out.chunks_exact_mut(8)
                .zip([self.latency_ns, self.bytes, self.elapsed_ns, self.bad])
        {
            chunk.copy_from_slice(&value.to_le_bytes());
        }
    }

    /// Reads a cell [`encode`](Self::encode) wrote.
    pub fn decode(bytes: &[u8]) -> Self {
        let word =
            |i: usize| u64::from_le_bytes(bytes[i * 8..i * 8 + 8].try_into().unwrap_or_default());
        Cell {
            latency_ns: word(0),
            bytes: word(1),
            elapsed_ns: word(2),
            bad: word(3),
        }
    }

    /// The stream's bandwidth.
    pub fn mib_per_sec(&self) -> f64 {
        if self.elapsed_ns == 0 {
            return 0.0;
        }
        self.bytes as f64 / (self.elapsed_ns as f64 / 1e9) / f64::from(1 << 20)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cells_and_immediates_survive_the_trip() {
        let cell = Cell {
            latency_ns: 1,
            bytes: 2 << 40,
            elapsed_ns: 3,
            bad: u64::MAX,
        };
        let mut buf = [0; CELL_BYTES];
        cell.encode(&mut buf);
        assert_eq!(Cell::decode(&buf), cell);
        assert_eq!(untagged(tagged(END, 0x1234_5678)), (END, 0x34_5678));
    }
}
