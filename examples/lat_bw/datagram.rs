//! `--transport ud`: SEND latency and message rate over unreliable
//! datagrams, on a datagram endpoint of the reactor at each end
//! (`Reactor::add_datagram`). The session (authenticated as for RC) carries
//! the two endpoints' addresses, then the client's word that it is done.

use std::time::Duration;

use rdma_comm_core::reactor::*;
use rdma_comm_core::session::*;
use rdma_comm_core::verbs::*;
use rdma_perf::*;

use super::{Args, Row, TestArg, common, reactor_config, spec};

/// Receives an endpoint keeps posted (ib_send_bw's default rx depth).
const RECEIVES: u32 = 512;

/// Runs one size over UD (listening on or connecting to `addr`).
pub(crate) fn measure_ud(
    args: &Args,
    pd: &ProtectionDomain,
    addr: &str,
    size: usize,
) -> rdma_comm_core::Result<Row> {
    let spec = spec(args, size);
    let bandwidth = args.test == TestArg::Bw;
    let mut reactor: Reactor<PerfHandler> = Reactor::new(pd, reactor_config(args, size))?;
    let config = UdConfig {
        max_send_wr: (args.tx_depth as u32).clamp(2, 4096),
        max_recv_wr: RECEIVES,
        port: args.dev.ib_port,
        gid_index: args.dev.gid_index,
        ..UdConfig::default()
    };
    let role = match (args.server, bandwidth) {
        (true, _) => PerfHandler::UdServer(UdServer::new(bandwidth)),
        (false, true) => PerfHandler::UdClient(UdClient::bandwidth(spec)),
        (false, false) => PerfHandler::UdClient(UdClient::latency(spec)),
    };
    let dgram = reactor.add_datagram(&config, |_, _| Ok(role))?;
    let qp = reactor
        .datagram_qp(dgram)
        .ok_or(rdma_comm_core::Error::InvalidArgument(
            "the endpoint vanished",
        ))?;
    if size > qp.max_datagram() as usize {
        return Err(rdma_comm_core::Error::InvalidArgument(
            "--size: a datagram is at most the port's MTU",
        ));
    }
    let mine = qp.endpoint();
    let endpoint = if args.server {
        let mut config = reactor.server_config(AccessFlags::empty());
        args.dev.apply(&mut config.qp);
        config.max_peers = Some(1);
        args.auth.secure(&mut config)?;
        config.transport = args.transport.transport();
        common::report_refusals("lat_bw", &mut config);
        ServerSession::bind(addr, pd, config)?.accept().ok_or(
            rdma_comm_core::Error::InvalidArgument("the listener stopped"),
        )?
    } else {
        let mut spec = reactor.qp_spec("perf");
        args.dev.apply(&mut spec.qp);
        let mut config = ClientConfig::new(vec![spec]);
        config.connect_deadline = Duration::from_secs(60);
        config.auth_key = args.auth.key()?;
        config.transport = args.transport.transport();
        ClientSession::connect(addr, pd, &config)?
    };
    let peer_addr = endpoint.peer();
    let session = reactor.add(endpoint, PerfHandler::UdExchange(UdExchange::new(mine)))?;
    // Until the peer's endpoint came.
    reactor.run()?;
    let exchange = match reactor.handler(session) {
        Some(PerfHandler::UdExchange(exchange)) => exchange,
        _ => return Err(protocol(peer_addr, "the session vanished")),
    };
    if let Some(failure) = exchange.failure() {
        return Err(protocol(peer_addr, failure));
    }
    let (theirs, conn) = (exchange.peer(), exchange.conn());
    let theirs = theirs.ok_or_else(|| protocol(peer_addr, "no UD endpoint came"))?;
    let to = reactor
        .datagram_qp(dgram)
        .ok_or(rdma_comm_core::Error::InvalidArgument(
            "the endpoint vanished",
        ))?
        .destination(&theirs)?;
    match reactor.datagram_handler_mut(dgram) {
        Some(PerfHandler::UdClient(client)) => client.start(dgram, to),
        Some(PerfHandler::UdServer(server)) => server.start(to),
        _ => return Err(protocol(peer_addr, "the endpoint's handler vanished")),
    }
    // The measurement: the client stops itself; the server stops on the
    // client's word over the session.
    reactor.run()?;
    let failure = [reactor.handler(session), reactor.datagram_handler(dgram)]
        .into_iter()
        .flatten()
        .find_map(|handler| handler.failure().map(str::to_owned));
    if let Some(failure) = failure {
        return Err(protocol(peer_addr, &failure));
    }
    if args.server {
        return Ok(Row::Served);
    }
    if let Some(conn) = conn {
        reactor
            .with_ctx(|ctx| ctx.send(conn, &[], Some(DONE_MARKER)))
            .map_err(|err| protocol(peer_addr, &err.to_string()))?;
        // Long enough for the word to go out (nothing stops it sooner).
        let _reached = reactor.run_for(Duration::from_millis(50))?;
    }
    // Taken out in exchange for a server role, which (unlike a client)
    // calibrates no clock.
    let taken = reactor
        .datagram_handler_mut(dgram)
        .map(|handler| std::mem::replace(handler, PerfHandler::UdServer(UdServer::new(false))));
    let Some(PerfHandler::UdClient(client)) = taken else {
        return Err(protocol(peer_addr, "the endpoint's handler vanished"));
    };
    if client.resent() > 0 {
        eprintln!(
            "lat_bw: {} datagrams went again for want of an answer within {:?}",
            client.resent(),
            RESEND_AFTER
        );
    }
    if bandwidth {
        let stats = client.stats();
        if let Some(received) = client.received() {
            eprintln!(
                "lat_bw: the server received {received} of {} datagrams",
                stats.iters
            );
        }
        return Ok(Row::Bandwidth(stats));
    }
    client
        .into_latency_stats()
        .map(Row::Latency)
        .ok_or_else(|| protocol(peer_addr, "no latency sample"))
}

fn protocol(peer: std::net::SocketAddr, what: &str) -> rdma_comm_core::Error {
    rdma_comm_core::Error::Protocol {
        peer,
        what: what.into(),
    }
}
