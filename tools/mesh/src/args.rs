//! The command line: who this rank is, what traffic to run, where the
//! reactors go.

use clap::{Parser, ValueEnum};

use crate::common;

/// Full-mesh RDMA traffic with verified data, per-pair latency and bandwidth.
#[derive(Parser, Debug)]
#[command(version)]
pub struct Args {
    /// This rank (default: from mpirun or srun).
    #[arg(long, requires = "size")]
    pub rank: Option<usize>,
    /// Number of ranks (default: from mpirun or srun).
    #[arg(long, requires = "rank")]
    pub size: Option<usize>,
    /// Host of every rank, comma-separated (or one per node, ranks in blocks).
    #[arg(long, value_delimiter = ',', conflicts_with = "hostfile")]
    pub hosts: Option<Vec<String>>,
    /// Open MPI style hostfile (`host slots=N` per line).
    #[arg(long)]
    pub hostfile: Option<std::path::PathBuf>,
    /// Rank r listens on this port plus r.
    #[arg(long, default_value_t = 7600)]
    pub base_port: u16,
    /// Traffic to stream.
    #[arg(long, value_enum, default_value_t = OpArg::Write)]
    pub op: OpArg,
    /// Bytes per message, 1 B to 16 MiB.
    #[arg(short = 's', long, default_value_t = 64 * 1024, value_parser = common::range(1usize, MAX_MSG_SIZE))]
    pub msg_size: usize,
    /// Seconds each stream runs, 0 to a day.
    #[arg(long, default_value_t = 5.0, conflicts_with = "bytes", value_parser = common::range(0.0f64, 86_400.0))]
    pub duration: f64,
    /// Bytes each stream carries instead (suffixes K, M, G).
    #[arg(long, value_parser = parse_bytes)]
    pub bytes: Option<u64>,
    /// Ping-pongs per pair for the latency figures (0: none); their
    /// statistics take constant memory.
    #[arg(long, default_value_t = 1000)]
    pub lat_iters: u32,
    /// Messages in flight per stream (receive ring and inbox blocks), 4 to
    /// 4096.
    #[arg(long, default_value_t = 32, value_parser = common::range(4u32, 4096))]
    pub depth: u32,
    /// Skip filling and checking the payload (peak bandwidth only).
    #[arg(long)]
    pub no_verify: bool,
    /// Seconds to wait for all ranks to connect, at least 1.
    #[arg(long, default_value_t = 60, value_parser = common::at_least(1u64))]
    pub connect_timeout: u64,
    /// Rank 0 also writes the matrices as JSON here.
    #[arg(long, value_name = "FILE")]
    pub json: Option<String>,
    /// Reactor threads of this rank, each pinned to a core of its own;
    /// reactor p % N serves the session with peer rank p.
    #[arg(long, default_value_t = 1, value_parser = common::range(1u16, u16::MAX))]
    pub reactors: u16,
    /// Leave the reactor threads unpinned (default: cores near the NIC,
    /// chosen by the node-local rank).
    #[arg(long)]
    pub no_pin: bool,
    /// Pin the reactors of the rank with node-local rank i to entries
    /// i*N to i*N+N-1 of this list, N being --reactors (e.g. 0,2,4-7; with
    /// one reactor, the i-th core), instead of choosing cores near the NIC.
    #[arg(long, value_name = "LIST", conflicts_with = "no_pin")]
    pub cores: Option<String>,
    /// Device, port and GID (clap shows no doc of a flattened group).
    #[command(flatten)]
    pub dev: common::DeviceArgs,
    /// The shared key.
    #[command(flatten)]
    pub auth: common::AuthArgs,
    /// Event mode, signaling, batch size.
    #[command(flatten)]
    pub reactor: common::ReactorArgs,
}

/// Largest message (`--msg-size`): 16 MiB.
pub const MAX_MSG_SIZE: usize = 16 << 20;

/// The operation that carries the streams.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum OpArg {
    /// WRITE_WITH_IMM into a ring the peer exports.
    Write,
    /// SENDs into the peer's receive slots.
    Send,
}

/// A byte count with an optional unit: `512`, `64K`, `1M`, `2G` (or KiB...).
pub fn parse_bytes(text: &str) -> Result<u64, String> {
    let text = text.trim();
    let (digits, unit) = match text.char_indices().find(|(_, c)| !c.is_ascii_digit()) {
        Some((i, _)) => text.split_at(i),
        None => (text, ""),
    };
    let scale = match unit.to_ascii_uppercase().as_str() {
        "" | "B" => 1,
        "K" | "KIB" => 1 << 10,
        "M" | "MIB" => 1 << 20,
        "G" | "GIB" => 1 << 30,
        _ => return Err(format!("unknown unit {unit:?} (use K, M or G)")),
    };
    digits
        .parse::<u64>()
        .ok()
        .and_then(|n| n.checked_mul(scale))
        .ok_or_else(|| format!("{text:?} is not a byte count"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn byte_counts_take_binary_units_and_refuse_the_rest() {
        assert_eq!(parse_bytes("512"), Ok(512));
        assert_eq!(parse_bytes("2M"), Ok(2 << 20));
        assert_eq!(parse_bytes("1gib"), Ok(1 << 30));
        assert!(parse_bytes("3T").unwrap_err().contains("unknown unit"));
        assert!(parse_bytes("M").unwrap_err().contains("not a byte count"));
        assert!(parse_bytes("99999999999G").is_err());
    }

    #[test]
    fn values_out_of_range_are_refused_not_clamped() {
        for (flag, value) in [
            ("--depth", "3"),
            ("--depth", "4097"),
            ("--msg-size", "0"),
            ("--duration", "nan"),
            ("--duration", "86401"),
            ("--connect-timeout", "0"),
            ("--reactors", "0"),
        ] {
            let err = Args::try_parse_from(["mesh", flag, value]).unwrap_err();
            assert_eq!(
                err.kind(),
                clap::error::ErrorKind::ValueValidation,
                "{flag} {value}: {err}"
            );
        }
        let args =
            Args::try_parse_from(["mesh", "--depth", "4", "-s", "1", "--duration", "0"]).unwrap();
        assert_eq!((args.depth, args.msg_size, args.duration), (4, 1, 0.0));
    }
}
