//! `--reactors N`: N streams at once, stream i on reactor i of a runtime of
//! pinned reactors on both sides.

use std::sync::Arc;
use std::time::Duration;

use rdma_comm_core::runtime::*;
use rdma_comm_core::session::*;
use rdma_comm_core::verbs::*;
use rdma_perf::*;

use crate::{Args, Row, endpoint_addr, handler_for, reactor_config, row_of, spec};

/// Server: each peer's stream, by its address (for its export).
type Offered = std::sync::Mutex<std::collections::HashMap<std::net::SocketAddr, usize>>;

/// Builds each stream's handler on the runtime reactor that serves it,
/// with that stream's buffer, and reports what it measured once its
/// handler stops its reactor.
struct Streams {
    args: &'static Args,
    spec: PerfSpec,
    /// Each stream's buffer until its handler takes it.
    buffers: Arc<std::sync::Mutex<Vec<Option<MemoryRegion>>>>,
    /// (reactor, what its stream measured).
    done: std::sync::mpsc::Sender<(usize, rdma_comm_core::Result<Row>)>,
}

impl HandlerFactory for Streams {
    type Handler = PerfHandler;

    fn build(&self, session: &NewSession<'_>) -> rdma_comm_core::Result<PerfHandler> {
        let endpoint = session.endpoint;
        let peer_addr = endpoint.peer();
        let protocol = |what: &str| rdma_comm_core::Error::Protocol {
            peer: peer_addr,
            what: what.into(),
        };
        // Stream i is served by reactor i on both sides.
        let index = session.reactor;
        let buffer = self
            .buffers
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get_mut(index)
            .and_then(Option::take)
            .ok_or_else(|| protocol("its stream's buffer is taken"))?;
        let peer = endpoint
            .remote_region("perf")
            .ok_or_else(|| protocol("peer exported no \"perf\" region"))?;
        Ok(handler_for(
            self.args,
            self.spec,
            PerfBuffers { buffer, peer },
        ))
    }

    fn refused(&self, reactor: usize, peer: std::net::SocketAddr, error: &rdma_comm_core::Error) {
        let what = format!("stream on reactor {reactor} refused: {error}");
        let _ = self
            .done
            .send((reactor, Err(rdma_comm_core::Error::Protocol { peer, what })));
    }

    fn stopped(&self, reactor: usize, handler: PerfHandler) {
        let peer = std::net::SocketAddr::from(([0, 0, 0, 0], 0));
        let _ = self.done.send((reactor, row_of(handler, peer)));
    }
}

/// One size on `streams` streams at once, stream i on reactor i of a
/// runtime of pinned reactors (the server listens once; the client
/// connects each stream as `stream-i`, which the server places on reactor
/// i). Each handler stops its reactor when its stream is over; the runtime
/// then ends.
pub(crate) fn measure_on_runtime(
    args: &'static Args,
    pd: &ProtectionDomain,
    streams: usize,
    choice: &CoreChoice,
    size: usize,
    first: bool,
) -> rdma_comm_core::Result<Vec<Row>> {
    let access = AccessFlags::REMOTE_WRITE | AccessFlags::REMOTE_READ;
    // Exported through a window per peer: no REMOTE_* rights of their own.
    let buffers = (0..streams)
        .map(|_| pd.alloc_mr(2 * size, AccessFlags::LOCAL_WRITE | AccessFlags::MW_BIND))
        .collect::<rdma_comm_core::Result<Vec<_>>>()?;
    let registrations: Vec<_> = buffers.iter().map(|b| b.registration().clone()).collect();
    let (done, results) = std::sync::mpsc::channel();
    let slots = Arc::new(std::sync::Mutex::new(Vec::new()));
    let offered = Arc::new(Offered::default());
    let factory = Streams {
        args,
        spec: spec(args, size),
        buffers: Arc::clone(&slots),
        done,
    };
    // Handlers take their buffers once these are filled in (below, before
    // any session can reach a reactor).
    let fill_slots = |buffers: Vec<MemoryRegion>| {
        *slots.lock().unwrap_or_else(|p| p.into_inner()) = buffers.into_iter().map(Some).collect();
    };
    // Stream i goes to reactor i, and the server remembers the peer's
    // stream for its export (placement runs first), so a stream that fails
    // halfway through its handshake shifts no other stream's buffer.
    let placed = Arc::clone(&offered);
    let by_stream: Arc<ChooseFn> = Arc::new(move |hello: &PeerHello, loads: &[ReactorLoad]| {
        let stream = hello
            .identity
            .strip_prefix("stream-")?
            .parse::<usize>()
            .ok()
            .filter(|&stream| stream < loads.len())?;
        placed
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(hello.peer, stream);
        Some(stream)
    });
    let config = RuntimeConfig {
        reactors: streams,
        cores: choice.clone(),
        reactor: reactor_config(args, size),
        policy: PlacementPolicy::Custom(by_stream),
        thread_name: "lat_bw".into(),
        ..RuntimeConfig::default()
    };
    let mut runtime = Runtime::start(pd, config, factory)?;
    if first {
        eprintln!("lat_bw: {streams} streams, {}", runtime.plan());
    }
    let handle = runtime.handle();
    if args.server {
        fill_slots(buffers);
        let mut config = runtime.server_config(access);
        args.dev.apply(&mut config.qp);
        config.max_peers = Some(streams);
        args.auth.secure(&mut config)?;
        config.transport = args.transport.transport();
        crate::common::report_refusals("lat_bw", &mut config);
        config.exports = Some(Arc::new(move |peer, _: &ProtectionDomain| {
            let stream = offered
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .get(&peer)
                .copied();
            let export = stream.and_then(|stream| registrations.get(stream)).ok_or(
                rdma_comm_core::Error::InvalidArgument("a peer that is no stream"),
            )?;
            Ok(vec![Export::new(1, "perf", export.clone(), access)])
        }));
        runtime.serve(args.listen.as_str(), config)?;
    } else {
        let addr = endpoint_addr(args);
        let mut endpoints = Vec::new();
        for (stream, buffer) in buffers.iter().enumerate() {
            let mut spec = handle.qp_spec(stream, "perf", access)?;
            args.dev.apply(&mut spec.qp);
            let mut config = ClientConfig::new(vec![spec])
                .with_exports(vec![Export::new(1, "perf", buffer, access)])
                .with_identity(format!("stream-{stream}"));
            config.connect_deadline = Duration::from_secs(60);
            config.auth_key = args.auth.key()?;
            config.transport = args.transport.transport();
            endpoints.push(ClientSession::connect(addr, pd, &config)?);
        }
        fill_slots(buffers);
        for (stream, endpoint) in endpoints.into_iter().enumerate() {
            handle.adopt(stream, endpoint)?;
        }
    }
    let mut rows: Vec<Option<rdma_comm_core::Result<Row>>> = (0..streams).map(|_| None).collect();
    for _ in 0..streams {
        let Ok((reactor, row)) = results.recv() else {
            break;
        };
        if let Some(slot) = rows.get_mut(reactor) {
            *slot = Some(row);
        }
    }
    // A stream refused or failed did not stop its reactor: stop them all.
    runtime.stop();
    runtime.join()?;
    rows.into_iter()
        .enumerate()
        .map(|(stream, row)| {
            row.unwrap_or_else(|| {
                Err(rdma_comm_core::Error::Runtime(format!(
                    "stream {stream} ended without a result"
                )))
            })
        })
        .collect()
}
