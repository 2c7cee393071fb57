//! Rank 0's view of the whole mesh: the latency and bandwidth matrices, in
//! words on stdout and as JSON.

use crate::args::Args;
use crate::cluster::World;
use crate::wire::Cell;

/// Every rank's row, gathered by rank 0.
#[derive(Debug)]
pub struct Report {
    /// What ran: ranks, launcher, operation, sizes.
    header: String,
    /// Number of ranks.
    size: usize,
    /// `cells[from][to]`
    cells: Vec<Vec<Cell>>,
    /// Messages that arrived corrupted, misplaced or out of order, all pairs.
    pub bad: u64,
}

impl Report {
    /// The report of a run with `cells[from][to]` (the diagonal unused).
    pub fn new(args: &Args, world: &World, cells: Vec<Vec<Cell>>) -> Self {
        let bad = cells.iter().flatten().map(|c| c.bad).sum();
        let limit = match args.bytes {
            Some(bytes) => format!("{bytes} bytes per stream"),
            None => format!("{} s per stream", args.duration),
        };
        let header = format!(
            "mesh: {} ranks ({}), {:?}, {} B messages, {limit}, {}",
            world.size,
            world.launcher,
            args.op,
            args.msg_size,
            if args.no_verify {
                "data not verified"
            } else {
                "data verified"
            }
        );
        Report {
            header,
            size: world.size,
            cells,
            bad,
        }
    }

    /// Prints one matrix of `value` of every cell, the diagonal blank.
    fn matrix(&self, title: &str, value: impl Fn(&Cell) -> f64) {
        println!("{title}");
        print!("{:>6}", "");
        for to in 0..self.size {
            print!("{to:>11}");
        }
        println!();
        for from in 0..self.size {
            print!("{from:>6}");
            for to in 0..self.size {
                if from == to {
                    print!("{:>11}", "-");
                } else {
                    print!("{:>11.2}", value(&self.cells[from][to]));
                }
            }
            println!();
        }
    }

    /// Every pair's cell (the diagonal left out).
    fn pairs(&self) -> impl Iterator<Item = &Cell> {
        self.cells.iter().enumerate().flat_map(|(from, row)| {
            row.iter()
                .enumerate()
                .filter(move |(to, _)| *to != from)
                .map(|(_, c)| c)
        })
    }

    /// Prints the header, both matrices and the aggregate line.
    pub fn print(&self) {
        println!("{}", self.header);
        self.matrix(
            "latency, half round trip, median [usec] (row: from, column: to)",
            |c| c.latency_ns as f64 / 1000.0,
        );
        self.matrix(
            "bandwidth [MiB/sec] (row: sender, column: receiver)",
            Cell::mib_per_sec,
        );
        let streams = self.pairs().count();
        let total: f64 = self.pairs().map(Cell::mib_per_sec).sum();
        let mut latencies: Vec<u64> = self.pairs().map(|c| c.latency_ns).collect();
        latencies.sort_unstable();
        let median = latencies.get(latencies.len() / 2).copied().unwrap_or(0);
        println!(
            "aggregate: {streams} streams, {total:.2} MiB/sec in total, {:.2} MiB/sec per stream, median latency {:.2} usec, {} bad messages",
            total / streams.max(1) as f64,
            median as f64 / 1000.0,
            self.bad
        );
    }

    /// The matrices as a JSON document (`--json`).
    pub fn json(&self) -> String {
        let matrix = |value: &dyn Fn(&Cell) -> f64| -> Vec<Vec<f64>> {
            self.cells
                .iter()
                .map(|row| row.iter().map(value).collect())
                .collect()
        };
        let doc = serde_json::json!({
            "summary": self.header,
            "latency_us": matrix(&|c| c.latency_ns as f64 / 1000.0),
            "bandwidth_mib_s": matrix(&Cell::mib_per_sec),
            "bytes": self.cells.iter().map(|row| row.iter().map(|c| c.bytes).collect::<Vec<_>>()).collect::<Vec<_>>(),
            "bad_messages": self.bad,
        });
        serde_json::to_string_pretty(&doc).unwrap_or_default()
    }
}
