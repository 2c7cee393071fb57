//! Prints every RDMA device with its ports, GID table and the GID this crate
//! would pick, like a compact `ibv_devinfo -v` plus `show_gids`.
//!
//! ```text
//! cargo run --example devinfo -- [--device NAME] [--gid-index N]
//! ```

use std::process::ExitCode;

mod common;

use clap::Parser;
use rdma_comm_core::verbs::{Context, LinkLayer, devices};

/// Show RDMA devices, ports and GIDs.
#[derive(Parser, Debug)]
#[command(version)]
struct Args {
    /// Only this device (default: all).
    #[arg(short, long)]
    device: Option<String>,
    /// GID index to report as selected (default: automatic).
    #[arg(short = 'x', long)]
    gid_index: Option<u32>,
}

fn main() -> ExitCode {
    common::init_logging();
    let args: Args = common::parse("devinfo");
    match run(&args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("devinfo: {err}");
            ExitCode::FAILURE
        }
    }
}

fn run(args: &Args) -> rdma_comm_core::Result<()> {
    let names = match &args.device {
        Some(name) => vec![name.clone()],
        None => devices()?,
    };
    if names.is_empty() {
        return Err(rdma_comm_core::Error::NoDevice(
            "found (no RDMA NIC? tools/run starts a Soft-RoCE guest)".into(),
        ));
    }
    for name in names {
        let ctx = Context::open(&name)?;
        let limits = ctx.query_device()?;
        println!("device {name}");
        println!(
            "  max_qp_wr {}  max_cqe {}  max_sge {}  max_qp_rd_atom {}",
            limits.max_qp_wr, limits.max_cqe, limits.max_sge, limits.max_qp_rd_atom
        );
        for port in 1..=limits.phys_port_cnt {
            let attr = ctx.query_port(port)?;
            println!(
                "  port {port}: {:?}  link {:?}  active_mtu {}  max_mtu {}  lid {}",
                attr.state,
                attr.link_layer,
                attr.active_mtu.bytes(),
                attr.max_mtu.bytes(),
                attr.lid
            );
            for entry in ctx.gid_table(port)? {
                println!(
                    "    GID[{:>3}] {:<40} {:?}",
                    entry.index,
                    entry.gid.to_string(),
                    entry.gid_type
                );
            }
            match ctx.select_gid(port, args.gid_index) {
                Ok(entry) => println!("    selected GID index {} ({})", entry.index, entry.gid),
                Err(err) if attr.link_layer == LinkLayer::InfiniBand => {
                    println!("    no GID selected ({err}); InfiniBand routes by LID")
                }
                Err(err) => println!("    no usable GID: {err}"),
            }
        }
    }
    Ok(())
}
