//! What the client prints and draws: perftest's banner, and the SVG curve
//! against message size.

use rdma_comm_core::verbs::*;
use rdma_perf::*;

use crate::{Args, OpArg, ServiceArg, TestArg, event_mode_label, plot};

pub(crate) fn print_banner(args: &Args, ctx: &Context) -> rdma_comm_core::Result<()> {
    let port = args
        .dev
        .ib_port
        .map_or_else(|| ctx.first_active_port(), Ok)?;
    let attr = ctx.query_port(port)?;
    let gid = ctx.select_gid(port, args.dev.gid_index)?;
    let title = match (args.op, args.test) {
        (OpArg::Send, TestArg::Lat) => "Send Latency Test",
        (OpArg::Write, TestArg::Lat) => "RDMA_Write Latency Test",
        (OpArg::WriteImm, TestArg::Lat) => "RDMA_Write_Imm Latency Test",
        (OpArg::Read, TestArg::Lat) => "RDMA_Read Latency Test",
        (OpArg::Send, TestArg::Bw) => "Send BW Test",
        (OpArg::Write, TestArg::Bw) => "RDMA_Write BW Test",
        (OpArg::WriteImm, TestArg::Bw) => "RDMA_Write_Imm BW Test",
        (OpArg::Read, TestArg::Bw) => "RDMA_Read BW Test",
    };
    println!("{}", "-".repeat(87));
    let service = match args.service {
        ServiceArg::Rc => "",
        ServiceArg::Ud => ", UD",
    };
    println!("                    {title} (rdma-comm-core reactor{service})");
    println!(
        " Device: {}  Port: {port}  GID index: {}  MTU: {}  Event mode: {}  Signal: every {}  Batch: {}",
        ctx.name(),
        gid.index,
        attr.active_mtu.bytes(),
        event_mode_label(args),
        args.reactor.signal_interval,
        args.reactor.batch_or(16)
    );
    println!("{}", "-".repeat(87));
    match args.test {
        TestArg::Lat => println!("{LATENCY_HEADER}"),
        TestArg::Bw => println!("{}", bandwidth_header(args.report_gbits)),
    }
    Ok(())
}

/// Draws the measured curve (latency: typical and 99th percentile;
/// bandwidth: average) against message size.
pub(crate) fn plot(
    path: &str,
    args: &Args,
    device: &str,
    results: &[serde_json::Value],
) -> Result<(), String> {
    use plotters::style::{BLUE, RED};

    let wanted = match args.test {
        TestArg::Lat => vec![
            ("t_typical_us", "typical", BLUE),
            ("p99_us", "99th percentile", RED),
        ],
        TestArg::Bw => vec![("bw_avg_mib_s", "average", BLUE)],
    };
    let series: Vec<plot::Series> = wanted
        .into_iter()
        .map(|(key, label, color)| plot::Series {
            label: label.into(),
            color,
            points: results
                .iter()
                .filter_map(|r| Some((r["bytes"].as_f64()?, r[key].as_f64()?)))
                .collect(),
        })
        .collect();
    let (title, y_desc) = match args.test {
        TestArg::Lat => ("latency", "usec"),
        TestArg::Bw => ("bandwidth", "MiB/sec"),
    };
    let chart = plot::Chart {
        path,
        caption: format!("{:?} {title} on {device} (rdma-comm-core)", args.op),
        x_desc: "message size [bytes]",
        y_desc,
        x_label: &|bytes| human_bytes(*bytes),
    };
    plot::draw(&chart, &series)
}

fn human_bytes(bytes: f64) -> String {
    match bytes.round() {
        b if b >= f64::from(1 << 20) => format!("{}M", (b / f64::from(1 << 20)).round()),
        b if b >= 1024.0 => format!("{}K", (b / 1024.0).round()),
        b => format!("{b}"),
    }
}
