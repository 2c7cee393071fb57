//! The feed's datagrams (a sequence number, the publisher's clock and a
//! pattern of the number, or an end mark with the count), and what a
//! subscriber makes of them: the tally of gaps, late and altered
//! datagrams, one-way latencies, and the summary it prints.

use std::time::{Instant, SystemTime};

use crate::GroupArgs;
use crate::rtt::RttRecorder;

/// The sequence number of the end mark.
pub(crate) const END: u64 = u64::MAX;

/// Where a datagram's send time is: after its sequence number.
pub(crate) const SENT_AT: usize = 8;

/// Where the pattern starts (and, in the end mark, the count).
pub(crate) const PATTERN_AT: usize = 16;

/// The smallest datagram: the sequence number, the send time, and the end
/// mark's count where the others have their pattern.
pub(crate) const MIN_SIZE: usize = PATTERN_AT + 8;

/// Datagram `seq`'s bytes: its number, the send time `sent_ns`, then a
/// pattern of the number.
pub(crate) fn fill(datagram: &mut [u8], seq: u64, sent_ns: u64) {
    datagram[..SENT_AT].copy_from_slice(&seq.to_le_bytes());
    stamp(datagram, sent_ns);
    fill_pattern(&mut datagram[PATTERN_AT..], seq);
}

/// Writes the send time into a filled datagram.
pub(crate) fn stamp(datagram: &mut [u8], sent_ns: u64) {
    datagram[SENT_AT..PATTERN_AT].copy_from_slice(&sent_ns.to_le_bytes());
}

pub(crate) fn fill_pattern(pattern: &mut [u8], seq: u64) {
    for (i, byte) in pattern.iter_mut().enumerate() {
        *byte = (seq as u8).wrapping_mul(31).wrapping_add(i as u8);
    }
}

/// The little-endian number at `at` in `bytes`; 0 where `bytes` is too
/// short (the callers check the length first, so this is never hit).
pub(crate) fn word(bytes: &[u8], at: usize) -> u64 {
    bytes
        .get(at..at + 8)
        .and_then(|word| word.try_into().ok())
        .map_or(0, u64::from_le_bytes)
}

/// This host's `CLOCK_REALTIME` in nanoseconds since the Unix epoch: the
/// clock two hosts can agree on (through NTP or PTP), unlike a monotonic
/// one, which starts at each host's boot.
pub(crate) fn realtime_ns() -> u64 {
    SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0, |since| {
            u64::try_from(since.as_nanos()).unwrap_or(u64::MAX)
        })
}

/// One-way latencies: the subscriber's clock at the receive minus the send
/// time the datagram carries, in constant memory.
#[derive(Debug, Default)]
pub(crate) struct Latency {
    /// The latencies of the datagrams received after they were sent.
    times: RttRecorder,
    /// Datagrams received before their send time by the two clocks: the
    /// hosts' clocks differ by more than the latency. Kept out of the
    /// percentiles, which have no negative times.
    skewed: u64,
}

impl Latency {
    fn record(&mut self, sent_ns: u64, received_ns: u64) {
        match received_ns.checked_sub(sent_ns) {
            Some(ns) => self.times.record(ns),
            None => self.skewed += 1,
        }
    }

    /// p50, p99, p99.9 and max in microseconds; `None` when no datagram
    /// was timed (none received, all skewed, or `--raw`).
    fn percentiles_us(&self) -> Option<[f64; 4]> {
        (self.times.count() > 0).then(|| [0.5, 0.99, 0.999, 1.0].map(|q| self.times.quantile_us(q)))
    }

    /// The summary line's part: `one-way us: p50 A p99 B p99.9 C max D, N
    /// skewed`.
    fn text(&self) -> String {
        match self.percentiles_us() {
            Some([p50, p99, p999, max]) => format!(
                "one-way us: p50 {p50:.2} p99 {p99:.2} p99.9 {p999:.2} max {max:.2}, {} skewed",
                self.skewed
            ),
            None => format!("one-way us: none timed, {} skewed", self.skewed),
        }
    }

    /// The JSON object's members: `"p50_us":A,...,"skewed":N` (`null`s when
    /// nothing was timed).
    fn json(&self) -> String {
        let [p50, p99, p999, max] = match self.percentiles_us() {
            Some(us) => us.map(|us| format!("{us:.3}")),
            None => std::array::from_fn(|_| "null".to_string()),
        };
        format!(
            "\"p50_us\":{p50},\"p99_us\":{p99},\"p999_us\":{p999},\"max_us\":{max},\"skewed\":{}",
            self.skewed
        )
    }
}

/// What a subscriber counted.
#[derive(Debug, Default)]
pub(crate) struct Tally {
    received: u64,
    /// Jumps in the sequence: runs of datagrams that never came.
    gaps: u64,
    /// Datagrams the gaps skipped.
    missing: u64,
    /// Datagrams older than one already seen (reordered or repeated).
    late: u64,
    /// Datagrams whose bytes were not the pattern of their number, or too
    /// short to hold one.
    altered: u64,
    next: u64,
    latency: Latency,
}

impl Tally {
    /// The publisher sent `total`: those after the last one seen are missing.
    fn end(&mut self, total: u64) {
        if total > self.next {
            self.gaps += 1;
            self.missing += total - self.next;
            self.next = total;
        }
    }

    /// Counts a datagram other than the end mark, received at `received_ns`
    /// by this host's clock. Its send time is the publisher's word, checked
    /// by nothing: a pattern cannot cover a clock reading.
    fn count(&mut self, datagram: &[u8], expected: &mut Vec<u8>, received_ns: u64) {
        if datagram.len() < MIN_SIZE {
            self.altered += 1;
            return;
        }
        let seq = word(datagram, 0);
        expected.resize(datagram.len() - PATTERN_AT, 0);
        fill_pattern(expected, seq);
        if datagram[PATTERN_AT..] != expected[..] {
            self.altered += 1;
            return;
        }
        self.received += 1;
        self.latency.record(word(datagram, SENT_AT), received_ns);
        if seq < self.next {
            self.late += 1;
            return;
        }
        if seq > self.next {
            self.gaps += 1;
            self.missing += seq - self.next;
        }
        self.next = seq + 1;
    }
}

/// The end mark's count, when `datagram` is an end mark.
pub(crate) fn end_mark(datagram: &[u8]) -> Option<u64> {
    (datagram.len() >= MIN_SIZE && word(datagram, 0) == END).then(|| word(datagram, PATTERN_AT))
}

/// What a subscriber does with each datagram, on either path: counts it
/// (raw, or checked against its number's pattern and timed), and says when
/// to stop.
pub(crate) struct Sink {
    raw: bool,
    count: Option<u64>,
    tally: Tally,
    expected: Vec<u8>,
    first: Option<Instant>,
    pub(crate) ended: bool,
}

impl Sink {
    pub(crate) fn new(raw: bool, count: Option<u64>) -> Self {
        Self {
            raw,
            count,
            tally: Tally::default(),
            expected: Vec::with_capacity(4096),
            first: None,
            ended: false,
        }
    }

    /// Takes one received datagram's payload (`None`: a completion that
    /// carried none), received at `received_ns` by this host's clock.
    pub(crate) fn take(&mut self, payload: Option<&[u8]>, received_ns: u64) {
        match payload {
            // Any payload counts; its length is the completion's.
            Some(_) if self.raw => {
                self.first.get_or_insert_with(Instant::now);
                self.tally.received += 1;
            }
            Some(bytes) => {
                if let Some(total) = end_mark(bytes) {
                    // It says how many were published: the last ones may be missing too.
                    self.tally.end(total);
                    self.ended = true;
                } else {
                    self.first.get_or_insert_with(Instant::now);
                    self.tally.count(bytes, &mut self.expected, received_ns);
                }
            }
            None if self.raw => {}
            None => self.tally.altered += 1,
        }
        if self.count.is_some_and(|count| self.tally.received >= count) {
            self.ended = true;
        }
    }

    /// Prints the summary line (or the JSON object); true if anything
    /// came and nothing came altered.
    pub(crate) fn report(&self, args: &GroupArgs, json: bool) -> bool {
        let tally = &self.tally;
        let ended = self.ended;
        let secs = self
            .first
            .map_or(0.0, |first| first.elapsed().as_secs_f64());
        let rate = if secs > 0.0 {
            tally.received as f64 / secs
        } else {
            0.0
        };
        if json {
            println!(
                "{{\"group\":\"{}\",\"received\":{},\"gaps\":{},\"missing\":{},\"late\":{},\"altered\":{},\"ended\":{ended},\"rate\":{rate:.0},{}}}",
                args.group,
                tally.received,
                tally.gaps,
                tally.missing,
                tally.late,
                tally.altered,
                tally.latency.json()
            );
        } else {
            println!(
                "received {} datagrams from {}: {} gaps ({} missing), {} late, {} altered, {} ({rate:.0}/s); {}",
                tally.received,
                args.group,
                tally.gaps,
                tally.missing,
                tally.late,
                tally.altered,
                if ended {
                    "ended"
                } else {
                    "no end mark before the timeout"
                },
                tally.latency.text(),
            );
        }
        tally.received > 0 && tally.altered == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Datagram `seq` of `size` bytes, sent at `sent_ns`.
    fn datagram(seq: u64, sent_ns: u64, size: usize) -> Vec<u8> {
        let mut bytes = vec![0; size];
        fill(&mut bytes, seq, sent_ns);
        bytes
    }

    #[test]
    fn a_datagram_carries_its_number_its_send_time_and_a_pattern() {
        let bytes = datagram(7, 1_234_567_890, 64);
        assert_eq!(word(&bytes, 0), 7);
        assert_eq!(word(&bytes, SENT_AT), 1_234_567_890);
        let mut tally = Tally::default();
        tally.count(&bytes, &mut Vec::new(), 1_234_567_890 + 52_000);
        assert_eq!((tally.received, tally.altered), (1, 0));
        assert_eq!(tally.latency.times.count(), 1);
        assert_eq!(tally.latency.times.quantile_ns(1.0), 52_000);
        assert_eq!(end_mark(&bytes), None);
    }

    #[test]
    fn the_smallest_datagram_and_the_end_mark_fit_in_24_bytes() {
        assert_eq!(MIN_SIZE, 24);
        let mut mark = datagram(END, 5, MIN_SIZE);
        mark[PATTERN_AT..MIN_SIZE].copy_from_slice(&1000u64.to_le_bytes());
        assert_eq!(end_mark(&mark), Some(1000));
        assert_eq!(end_mark(&mark[..MIN_SIZE - 1]), None);
        let mut tally = Tally::default();
        tally.count(&datagram(0, 5, MIN_SIZE), &mut Vec::new(), 6);
        assert_eq!((tally.received, tally.altered), (1, 0));
    }

    #[test]
    fn a_short_or_changed_datagram_counts_as_altered_and_is_not_timed() {
        let mut tally = Tally::default();
        let mut expected = Vec::new();
        for len in [0, 1, 8, 16, MIN_SIZE - 1] {
            tally.count(&datagram(0, 0, 64)[..len], &mut expected, 1);
        }
        let mut changed = datagram(0, 0, 64);
        changed[40] ^= 1;
        tally.count(&changed, &mut expected, 1);
        assert_eq!((tally.received, tally.altered), (0, 6));
        assert_eq!(tally.latency.times.count(), 0);
        // The send time is the publisher's word: nothing covers it.
        tally.count(&datagram(0, u64::MAX, 64), &mut expected, 1);
        assert_eq!((tally.received, tally.altered), (1, 6));
    }

    #[test]
    fn gaps_missing_and_late_datagrams_are_counted_and_every_one_received_is_timed() {
        let mut tally = Tally::default();
        let mut expected = Vec::new();
        for seq in [0, 1, 3, 2, 7, 8] {
            tally.count(
                &datagram(seq, 100, 32),
                &mut expected,
                100 + 1_000 * (seq + 1),
            );
        }
        tally.end(12);
        assert_eq!(tally.received, 6);
        assert_eq!(tally.gaps, 3, "before 3, before 7, after 8");
        assert_eq!(tally.missing, 1 + 3 + 3);
        assert_eq!(tally.late, 1);
        assert_eq!(tally.latency.times.count(), 6);
        assert_eq!(tally.latency.times.quantile_ns(0.0), 1_000);
        assert_eq!(tally.latency.times.quantile_ns(1.0), 9_000);
    }

    #[test]
    fn a_datagram_received_before_its_send_time_is_skewed_and_left_out() {
        let mut latency = Latency::default();
        latency.record(2_000, 1_000);
        assert_eq!((latency.skewed, latency.times.count()), (1, 0));
        assert_eq!(latency.percentiles_us(), None);
        assert_eq!(latency.text(), "one-way us: none timed, 1 skewed");
        latency.record(2_000, 2_000);
        latency.record(0, u64::MAX);
        assert_eq!((latency.skewed, latency.times.count()), (1, 2));
        let [p50, _, _, max] = latency.percentiles_us().unwrap();
        assert_eq!(p50, 0.0);
        assert_eq!(max, u64::MAX as f64 / 1e3, "the maximum stays exact");
    }

    #[test]
    fn the_percentiles_come_out_in_microseconds_in_the_line_and_the_json() {
        let mut latency = Latency::default();
        for us in 1..=1000u64 {
            latency.record(10, 10 + us * 1_000);
        }
        latency.record(5, 4);
        let [p50, p99, p999, max] = latency.percentiles_us().unwrap();
        for (got, exact) in [(p50, 500.0), (p99, 990.0), (p999, 999.0), (max, 1000.0)] {
            assert!((got - exact).abs() <= exact / 1000.0, "{got} for {exact}");
        }
        assert!(
            latency.text().starts_with("one-way us: p50 500.")
                && latency.text().ends_with(" max 1000.00, 1 skewed"),
            "{}",
            latency.text()
        );
        let json: serde_json::Value =
            serde_json::from_str(&format!("{{{}}}", latency.json())).unwrap();
        assert_eq!(json["max_us"].as_f64(), Some(1000.0));
        assert_eq!(json["p999_us"].as_f64(), Some(p999));
        assert_eq!(json["skewed"].as_u64(), Some(1));
        let none: serde_json::Value =
            serde_json::from_str(&format!("{{{}}}", Latency::default().json())).unwrap();
        for key in ["p50_us", "p99_us", "p999_us", "max_us"] {
            assert!(none[key].is_null(), "{key}: {none}");
        }
        assert_eq!(none["skewed"].as_u64(), Some(0));
    }
}
