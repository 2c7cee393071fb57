//! Setting a rank up: where it stands in the job, which cores its reactors
//! get, the runtime that runs them, the listener the higher ranks connect
//! to (each placed on reactor `rank % reactors`), the connections to the
//! lower ranks (adopted by the same rule), and the factory that builds each
//! peer's handler on its reactor.

use std::sync::Arc;
use std::time::Duration;

use rdma_comm_core::Error;
use rdma_comm_core::reactor::*;
use rdma_comm_core::runtime::*;
use rdma_comm_core::session::*;
use rdma_comm_core::verbs::*;
use rdma_perf::Clock;

use crate::args::{Args, OpArg};
use crate::board::Board;
use crate::cluster::{World, parse_hostfile};
use crate::common;
use crate::peer::{PeerHandler, Rings, Traffic};
use crate::wire::CELL_BYTES;

/// How often each reactor looks at every peer's control connection.
const PEER_CHECK_INTERVAL: Duration = Duration::from_millis(100);

/// Rank, size and hosts, from the flags or the launcher.
pub fn world(args: &Args) -> Result<World, String> {
    let hosts = match (&args.hosts, &args.hostfile) {
        (Some(hosts), _) => Some(hosts.clone()),
        (None, Some(path)) => {
            let text = std::fs::read_to_string(path)
                .map_err(|err| format!("reading {}: {err}", path.display()))?;
            Some(parse_hostfile(&text).map_err(|err| format!("{}: {err}", path.display()))?)
        }
        (None, None) => None,
    };
    World::discover(args.rank, args.size, hosts, |key| std::env::var(key).ok())
        .map_err(|err| err.to_string())
}

/// Checks what needs the job's shape, before the device is opened: every
/// rank's port exists, and this rank's entries of `--cores` (or the
/// machine's cores, for pinned reactors) give each reactor a usable core.
pub fn check(args: &Args, world: &World) -> Result<(), common::Refusal> {
    let highest = usize::from(args.base_port) + world.size - 1;
    if highest > usize::from(u16::MAX) {
        return Err(common::Refusal::new(
            "--base-port",
            args.base_port,
            format!(
                "must be at most {} with {} ranks (rank r listens on --base-port + r)",
                usize::from(u16::MAX) + 1 - world.size,
                world.size
            ),
        ));
    }
    if args.no_pin {
        return Ok(());
    }
    let reactors = usize::from(args.reactors);
    let Some(list) = &args.cores else {
        return common::check_reactor_count("--reactors", reactors);
    };
    let cores = parse_core_list(list)
        .map_err(|err| common::Refusal::new("--cores", list, common::reason(&err)))?;
    let mine = my_cores(&cores, world, reactors)
        .map_err(|why| common::Refusal::new("--cores", list, why))?;
    common::distinct_usable_cores("--cores", list, mine)
}

/// This rank's entries of a `--cores` list: node-local rank i takes
/// entries i·N to i·N+N−1, N being the reactors of a rank.
fn my_cores<'a>(cores: &'a [usize], world: &World, reactors: usize) -> Result<&'a [usize], String> {
    let first = world.local_rank * reactors;
    cores.get(first..first + reactors).ok_or_else(|| match reactors {
        1 => format!(
            "lists {} cores, but this node runs node-local rank {}",
            cores.len(),
            world.local_rank
        ),
        n => format!(
            "lists {} cores, but node-local rank {} with {n} reactors takes entries {first} to {}",
            cores.len(),
            world.local_rank,
            first + n - 1
        ),
    })
}

/// `host:port`, with an IPv6 host in brackets.
fn address(host: &str, port: u16) -> String {
    if host.contains(':') && !host.starts_with('[') {
        format!("[{host}]:{port}")
    } else {
        format!("{host}:{port}")
    }
}

/// The peer rank a QP name (`rank-N`) stands for.
fn rank_named(name: &str) -> Option<usize> {
    name.strip_prefix("rank-")?.parse().ok()
}

/// The rank a connecting peer says it is, from the name of its QP.
fn rank_in(hello: &PeerHello) -> Option<usize> {
    hello.qps.first().and_then(|name| rank_named(name))
}

/// The reactor that serves peer `rank`.
fn reactor_of(rank: usize, reactors: usize) -> usize {
    rank % reactors.max(1)
}

/// Where this rank's reactors run.
#[derive(Debug)]
pub struct Cores {
    /// The cores, for the runtime.
    pub choice: CoreChoice,
    /// Why the NIC's NUMA node could not guide the choice, if it could not.
    pub note: Option<String>,
}

/// The cores of this rank's `--reactors` N reactors: for node-local rank i,
/// entries i·N to i·N+N−1 of `--cores`, or of the cores near the NIC (then
/// the machine's others), wrapping around when the node has fewer (ranks
/// then share cores); none with `--no-pin`.
pub fn cores(args: &Args, world: &World, device: &str) -> Result<Cores, String> {
    let reactors = usize::from(args.reactors);
    let first = world.local_rank * reactors;
    if args.no_pin {
        return Ok(Cores {
            choice: CoreChoice::Unpinned,
            note: None,
        });
    }
    if let Some(list) = &args.cores {
        let cores = parse_core_list(list).map_err(|err| err.to_string())?;
        let mine = my_cores(&cores, world, reactors).map_err(|why| format!("--cores {why}"))?;
        return Ok(Cores {
            choice: CoreChoice::List(mine.to_vec()),
            note: None,
        });
    }
    // Every core this process may use, those of the NIC's node first.
    let usable = core_affinity::get_core_ids().map_or(0, |cores| cores.len());
    if usable == 0 {
        return Ok(Cores {
            choice: CoreChoice::Unpinned,
            note: Some("the cores this process may use could not be read".into()),
        });
    }
    let plan =
        CorePlan::choose(device, usable, &CoreChoice::NearDevice).map_err(|err| err.to_string())?;
    let order: Vec<usize> = plan.cores.iter().flatten().copied().collect();
    let mine = (first..first + reactors)
        .map(|i| order[i % order.len()])
        .collect();
    Ok(Cores {
        choice: CoreChoice::List(mine),
        note: plan.note,
    })
}

/// Every reactor's configuration: CQs for the peers one reactor serves at
/// most, receive slots large enough for a row of cells.
fn reactor_config(args: &Args, world: &World) -> ReactorConfig {
    let payload = match args.op {
        OpArg::Send => args.msg_size,
        OpArg::Write => 0,
    };
    let peers = world.size - 1;
    let per_reactor = world.size.div_ceil(usize::from(args.reactors)).min(peers);
    let base = ReactorConfig::for_traffic(0, args.depth, per_reactor.max(1) as u32);
    ReactorConfig {
        event_mode: args.reactor.event_mode_or(common::EventArg::Busy).into(),
        slot_size: (payload.max(world.size * CELL_BYTES).max(64) + SLOT_RESERVE)
            .next_multiple_of(64),
        signal_interval: args.reactor.signal_interval,
        repost_batch: args.reactor.repost_batch_or(base.repost_batch),
        peer_check_interval: Some(PEER_CHECK_INTERVAL),
        ..base
    }
}

/// What the streams need to know, from the flags.
fn traffic(args: &Args, world: &World) -> Traffic {
    Traffic {
        me: world.rank,
        size: world.size,
        op: args.op,
        // Each in its range (args.rs).
        msg_size: args.msg_size,
        blocks: u64::from(args.depth),
        verify: !args.no_verify,
        stream_ns: Some((args.duration * 1e9) as u64),
        stream_bytes: args.bytes,
        lat_iters: args.lat_iters,
        batch: args.reactor.batch_or(16),
    }
}

/// Bytes of a peer's ring (and of the source of our WRITEs to it).
fn ring_len(args: &Args) -> usize {
    args.msg_size * args.depth as usize
}

/// Our ring for one peer to WRITE into, as exported to it.
fn inbox(pd: &ProtectionDomain, len: usize) -> rdma_comm_core::Result<Export> {
    let inbox = pd.alloc_mr(len, AccessFlags::LOCAL_WRITE | AccessFlags::MW_BIND)?;
    Ok(Export::shared(
        1,
        "inbox",
        Arc::new(inbox),
        AccessFlags::REMOTE_WRITE,
    ))
}

/// What peers may do to our memory.
fn remote_access(op: OpArg) -> AccessFlags {
    match op {
        OpArg::Write => AccessFlags::REMOTE_WRITE,
        OpArg::Send => AccessFlags::empty(),
    }
}

/// Builds each peer's [`PeerHandler`] on the reactor that serves it.
struct Peers {
    /// The run's parameters, for every handler.
    traffic: Traffic,
    /// The calibrated clock every handler reads.
    clock: Arc<Clock>,
    /// What crosses peers.
    board: Arc<Board>,
    /// For the source regions of WRITE streams.
    pd: ProtectionDomain,
    /// Rank r listens on this port plus r.
    base_port: u16,
    /// Bytes of each peer's ring.
    ring_len: usize,
}

impl HandlerFactory for Peers {
    type Handler = PeerHandler;

    fn build(&self, session: &NewSession<'_>) -> rdma_comm_core::Result<PeerHandler> {
        let endpoint = session.endpoint;
        let peer = endpoint.peer();
        // A higher rank names itself in its QP's name; a lower one is the
        // one listening on its port.
        let rank = match session.hello {
            Some(hello) => rank_in(hello),
            None => usize::from(peer.port()).checked_sub(usize::from(self.base_port)),
        };
        let refuse = |what: String| Error::Protocol { peer, what };
        let rank = rank.ok_or_else(|| refuse("it is not a mesh rank we expect".into()))?;
        self.board.claim(rank).map_err(refuse)?;
        let source = match self.traffic.op {
            OpArg::Write => Some(self.pd.alloc_mr(self.ring_len, AccessFlags::empty())?),
            OpArg::Send => None,
        };
        let rings = Rings {
            inbox: endpoint.exports().first().and_then(|e| e.memory.clone()),
            remote: endpoint.remote_region("inbox"),
            source,
        };
        Ok(PeerHandler::new(
            rank,
            self.traffic,
            Arc::clone(&self.clock),
            Arc::clone(&self.board),
            rings,
        ))
    }

    fn refused(&self, reactor: usize, peer: std::net::SocketAddr, error: &Error) {
        let what = format!("reactor {reactor} did not take the session of {peer}: {error}");
        self.board.fail(None, what);
    }
}

/// Starts this rank's runtime on `cores` and listens for the higher ranks:
/// each is placed on the reactor of its rank, anyone else is refused (and
/// fails the run, as a mesh with strangers in it is no mesh).
pub fn start(
    args: &Args,
    world: &World,
    pd: &ProtectionDomain,
    cores: CoreChoice,
    board: &Arc<Board>,
) -> Result<Runtime, String> {
    let by_rank: Arc<ChooseFn> = Arc::new(|hello: &PeerHello, loads: &[ReactorLoad]| {
        rank_in(hello).map(|rank| reactor_of(rank, loads.len()))
    });
    let config = RuntimeConfig {
        reactors: usize::from(args.reactors),
        cores,
        reactor: reactor_config(args, world),
        policy: PlacementPolicy::Custom(by_rank),
        thread_name: "mesh-reactor".into(),
        ..RuntimeConfig::default()
    };
    let factory = Peers {
        traffic: traffic(args, world),
        clock: Arc::new(Clock::new()),
        board: Arc::clone(board),
        pd: pd.clone(),
        base_port: args.base_port,
        ring_len: ring_len(args),
    };
    let mut runtime = Runtime::start(pd, config, factory).map_err(|err| err.to_string())?;
    // What the board learns wakes the reactors (they sleep until woken).
    board.wake_through(runtime.handle());
    let access = remote_access(args.op);
    let mut config = runtime.server_config(access);
    args.dev.apply(&mut config.qp);
    config.max_peers = Some(world.size - 1 - world.rank);
    args.auth
        .secure(&mut config)
        .map_err(|err| err.to_string())?;
    let ring_len = ring_len(args);
    if !access.is_empty() {
        config.exports = Some(Arc::new(move |_, pd: &ProtectionDomain| {
            Ok(vec![inbox(pd, ring_len)?])
        }));
    }
    let (me, size) = (world.rank, world.size);
    let stranger = Arc::clone(board);
    config.authorize = Some(Arc::new(move |hello: &PeerHello| {
        if rank_in(hello).is_some_and(|rank| rank > me && rank < size) {
            return Ok(());
        }
        stranger.fail(None, format!("{} is not a mesh rank we expect", hello.peer));
        Err(Refusal::unauthorized("not a higher rank of this mesh"))
    }));
    let rejected = Arc::clone(board);
    config.on_failure = Some(Arc::new(move |failure: &HandshakeFailure| {
        rejected.reject(format!("{}: {}", failure.peer, failure.error));
    }));
    let listen = format!("0.0.0.0:{}", usize::from(args.base_port) + world.rank);
    runtime
        .serve(listen.as_str(), config)
        .map_err(|err| format!("listening on {listen}: {err}"))?;
    Ok(runtime)
}

/// Connects to every lower rank in turn and hands each to the reactor of
/// its rank. The first failure goes on the board (the run then gives up).
pub fn connect_lower(
    args: &Args,
    world: &World,
    pd: &ProtectionDomain,
    runtime: &RuntimeHandle,
    board: &Board,
) {
    for rank in 0..world.rank {
        if board.failed() {
            return;
        }
        if let Err(what) = connect(args, world, pd, runtime, rank) {
            board.fail(Some(rank), what);
            return;
        }
    }
}

/// Connects to rank `rank` and hands the endpoint to its reactor.
fn connect(
    args: &Args,
    world: &World,
    pd: &ProtectionDomain,
    runtime: &RuntimeHandle,
    rank: usize,
) -> Result<(), String> {
    let reactor = reactor_of(rank, runtime.reactors());
    let access = remote_access(args.op);
    let mut spec = runtime
        .qp_spec(reactor, format!("rank-{}", world.rank), access)
        .map_err(|err| err.to_string())?;
    args.dev.apply(&mut spec.qp);
    let mut client = ClientConfig::new(vec![spec]);
    if !access.is_empty() {
        let inbox = inbox(pd, ring_len(args)).map_err(|err| err.to_string())?;
        client = client.with_exports(vec![inbox]);
    }
    client.connect_deadline = Duration::from_secs(args.connect_timeout);
    client.auth_key = args.auth.key().map_err(|err| err.to_string())?;
    let peer = address(
        world.host(rank),
        (usize::from(args.base_port) + rank) as u16,
    );
    let endpoint = ClientSession::connect(peer.as_str(), pd, &client)
        .map_err(|err| format!("connecting to rank {rank} at {peer}: {err}"))?;
    runtime
        .adopt(reactor, endpoint)
        .map_err(|err| format!("handing rank {rank} to reactor {reactor}: {err}"))
}

/// Which peer ranks each reactor serves, in words.
pub fn describe_placement(world: &World, reactors: usize) -> String {
    let served: Vec<String> = (0..reactors)
        .map(|reactor| {
            let ranks: Vec<String> = (0..world.size)
                .filter(|&rank| rank != world.rank && reactor_of(rank, reactors) == reactor)
                .map(|rank| rank.to_string())
                .collect();
            match ranks.len() {
                0 => format!("reactor {reactor} serves no rank"),
                1 => format!("reactor {reactor} serves rank {}", ranks[0]),
                _ => format!("reactor {reactor} serves ranks {}", ranks.join(", ")),
            }
        })
        .collect();
    served.join(", ")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn peers_are_named_by_their_qp_and_placed_by_rank() {
        assert_eq!(rank_named("rank-12"), Some(12));
        assert_eq!(rank_named("rank-"), None);
        assert_eq!(rank_named("bulk"), None);
        assert_eq!(reactor_of(5, 2), 1);
        assert_eq!(reactor_of(5, 1), 0);
        let world = World::discover(Some(2), Some(5), Some(vec!["node".into()]), |_| None).unwrap();
        assert_eq!(
            describe_placement(&world, 2),
            "reactor 0 serves ranks 0, 4, reactor 1 serves ranks 1, 3"
        );
        assert_eq!(
            describe_placement(&world, 4),
            "reactor 0 serves ranks 0, 4, reactor 1 serves rank 1, reactor 2 serves no rank, reactor 3 serves rank 3"
        );
    }

    #[test]
    fn every_rank_needs_a_port_and_usable_cores_of_its_own() {
        use clap::Parser;
        let local_rank_1 = |key: &str| (key == "OMPI_COMM_WORLD_LOCAL_RANK").then(|| "1".into());
        let world =
            World::discover(Some(1), Some(4), Some(vec!["node".into()]), local_rank_1).unwrap();
        assert_eq!(world.local_rank, 1);
        let parse = |flags: &[&str]| Args::try_parse_from([&["mesh"][..], flags].concat()).unwrap();
        let refused = |flags: &[&str]| check(&parse(flags), &world).unwrap_err().to_string();
        assert!(check(&parse(&["--base-port", "65532", "--no-pin"]), &world).is_ok());
        let port = refused(&["--base-port", "65533", "--no-pin"]);
        assert!(
            port.starts_with("--base-port 65533: must be at most 65532"),
            "{port}"
        );
        // Node-local rank 1 with one reactor takes the second entry.
        let core = rdma_comm_core::reactor::usable_cores()[0].to_string();
        assert!(check(&parse(&["--cores", &format!("{core},{core}")]), &world).is_ok());
        let short = refused(&["--cores", &core]);
        assert!(short.contains("node-local rank 1"), "{short}");
        let beyond = refused(&["--cores", &format!("{core},100000")]);
        assert!(beyond.contains("may run on"), "{beyond}");
        let junk = refused(&["--cores", "x"]);
        assert!(junk.starts_with("--cores x: "), "{junk}");
        let twice = refused(&["--cores", &format!("0,1,{core},{core}"), "--reactors", "2"]);
        assert!(twice.contains("listed twice"), "{twice}");
    }

    #[test]
    fn addresses_bracket_ipv6_hosts() {
        assert_eq!(address("10.0.0.1", 7600), "10.0.0.1:7600");
        assert_eq!(address("fe80::1", 7601), "[fe80::1]:7601");
        assert_eq!(address("[::1]", 7602), "[::1]:7602");
    }
}
