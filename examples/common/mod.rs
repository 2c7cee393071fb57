//! Flags every example shares (each example includes this with `mod common;`,
//! and tools/mesh's `src/main.rs` with a `#[path]` to this file), the
//! checks that refuse a bad value before anything is opened ([`refusal`]),
//! and the logger every tool starts with.

// Each tool uses some of these.
#![allow(dead_code)]

use clap::Args;
use rdma_comm_core::verbs::QpConfig;

mod refusal;
#[allow(unused_imports)] // Each tool uses some of them.
pub use refusal::{
    Refusal, address, at_least, core_list, distinct_usable_cores, host, parse, parse_adjusted,
    range, reason,
};

/// Starts the logger before anything else: the library's warnings and
/// errors show (level warn), and `RUST_LOG` says more or less
/// (`RUST_LOG=debug`, `RUST_LOG=rdma_comm_core=info`).
pub fn init_logging() {
    env_logger::Builder::from_env(env_logger::Env::default().default_filter_or("warn")).init();
}

/// Which device, port and GID to use; everything is detected by default.
#[derive(Args, Debug, Clone)]
pub struct DeviceArgs {
    /// RDMA device (default: the first with an active port).
    #[arg(short = 'd', long)]
    pub device: Option<String>,
    /// Port number (default: the first active one).
    #[arg(short = 'i', long)]
    pub ib_port: Option<u8>,
    /// GID index (default: the RoCE v2 IPv4-mapped GID).
    #[arg(short = 'x', long)]
    pub gid_index: Option<u32>,
    /// RC ACK timeout exponent: a request is sent again after at least
    /// 4.096 us x 2^N without an ACK (default 14: 67 ms; 0: never). With
    /// --retry-cnt it bounds how long a dead peer takes to be noticed
    /// while requests are in flight: at least (retry-cnt + 1) x the
    /// timeout, up to about 4 times that.
    #[arg(long, value_name = "N", value_parser = range(0u8, 31))]
    pub qp_timeout: Option<u8>,
    /// RC transport retries before a request fails with
    /// IBV_WC_RETRY_EXC_ERR (default 7). Soft-RoCE (rxe) treats 7 as
    /// "retry forever", so there a QP notices a dead peer only with 6 or
    /// less (the InfiniBand specification makes 7 a count).
    #[arg(long, value_name = "N", value_parser = range(0u8, 7))]
    pub retry_cnt: Option<u8>,
    /// RNR retries before a SEND the peer had no receive for fails with
    /// IBV_WC_RNR_RETRY_EXC_ERR (default 7: forever).
    #[arg(long, value_name = "N", value_parser = range(0u8, 7))]
    pub rnr_retry: Option<u8>,
}

impl DeviceArgs {
    /// Applies the port and GID choice and the fault settings given to a
    /// QP configuration (the others keep `QpConfig`'s defaults).
    pub fn apply(&self, qp: &mut QpConfig) {
        qp.port = self.ib_port;
        qp.gid_index = self.gid_index;
        if let Some(timeout) = self.qp_timeout {
            qp.timeout = timeout;
        }
        if let Some(retry_cnt) = self.retry_cnt {
            qp.retry_cnt = retry_cnt;
        }
        if let Some(rnr_retry) = self.rnr_retry {
            qp.rnr_retry = rnr_retry;
        }
    }
}

/// The shared key both ends must prove (`--auth-key-file`, or the
/// `RDMA_COMM_AUTH_KEY` environment variable when no file is given), or
/// `--insecure` to run without one.
#[derive(Args, Debug, Clone, Default)]
pub struct AuthArgs {
    /// File holding the shared key: at least 32 bytes (say from `(umask
    /// 077; head -c 64 /dev/urandom > key)`), mode 600, one trailing
    /// newline ignored. Both
    /// ends need the same key. Without it, the RDMA_COMM_AUTH_KEY
    /// environment variable (also at least 32 bytes) is used when set.
    #[arg(long, value_name = "PATH")]
    pub auth_key_file: Option<std::path::PathBuf>,
    /// Run without a key: a server admits anyone who reaches its port, and
    /// a client talks to such servers. Only for closed networks and tests.
    #[arg(long, conflicts_with = "auth_key_file")]
    pub insecure: bool,
    /// The key [`load`](Self::load) read (`Some(None)`: `--insecure`).
    #[arg(skip)]
    loaded: Option<Option<rdma_comm_core::session::AuthKey>>,
}

impl AuthArgs {
    /// Reads the key (or takes `--insecure`) once, before anything is
    /// opened: a missing, unreadable or short key is refused naming the
    /// file or the variable. [`key`](Self::key) returns it from then on.
    pub fn load(&mut self) -> Result<(), Refusal> {
        use rdma_comm_core::session::{AUTH_KEY_ENV, AuthKey};
        if self.insecure {
            if std::env::var_os(AUTH_KEY_ENV).is_some() {
                return Err(Refusal::of(
                    "--insecure",
                    format!("{AUTH_KEY_ENV} is set too; use the key or unset it"),
                ));
            }
            self.loaded = Some(None);
            return Ok(());
        }
        let key = match &self.auth_key_file {
            Some(path) => AuthKey::from_file(path).map_err(|err| {
                let why = match &err {
                    // The refusal names the file itself.
                    rdma_comm_core::Error::KeyFile {
                        source: Some(source),
                        ..
                    } => format!(
                        "cannot be read ({source}); it must hold a key of at least 32 bytes"
                    ),
                    rdma_comm_core::Error::KeyFile { what, .. } => (*what).to_string(),
                    other => reason(other),
                };
                Refusal::new("--auth-key-file", path.display(), why)
            })?,
            None => AuthKey::from_env(AUTH_KEY_ENV)
                .map_err(|err| Refusal::of(AUTH_KEY_ENV, reason(&err)))?
                .ok_or_else(|| {
                    Refusal::of(
                        "--auth-key-file",
                        format!(
                            "no key given: name a file of at least 32 bytes, or set \
                             {AUTH_KEY_ENV} (--insecure runs without a key, open to anyone)"
                        ),
                    )
                })?,
        };
        self.loaded = Some(Some(key));
        Ok(())
    }

    /// The key to use: `None` only with `--insecure`. The one
    /// [`load`](Self::load) read; read now if it was not called.
    pub fn key(&self) -> Result<Option<rdma_comm_core::session::AuthKey>, rdma_comm_core::Error> {
        if let Some(loaded) = &self.loaded {
            return Ok(loaded.clone());
        }
        let mut fresh = self.clone();
        fresh.load().map_err(|refusal| {
            rdma_comm_core::Error::Runtime(format!("authentication key: {refusal}"))
        })?;
        Ok(fresh.loaded.flatten())
    }

    /// Sets a server's key, or opens it to anyone with `--insecure`.
    pub fn secure(
        &self,
        config: &mut rdma_comm_core::session::ServerConfig,
    ) -> Result<(), rdma_comm_core::Error> {
        config.auth_key = self.key()?;
        config.insecure_open = config.auth_key.is_none();
        Ok(())
    }
}

/// How a reactor waits (the `--event-mode` flag).
#[derive(clap::ValueEnum, Debug, Clone, Copy, PartialEq, Eq)]
pub enum EventArg {
    /// Spin on the CQs (one core at 100 %, lowest latency).
    Busy,
    /// Sleep on a completion channel.
    Blocking,
    /// Sleep in epoll over the CQs' channels.
    Epoll,
}

impl From<EventArg> for rdma_comm_core::reactor::EventMode {
    fn from(arg: EventArg) -> Self {
        match arg {
            EventArg::Busy => Self::BusyPoll,
            EventArg::Blocking => Self::Blocking,
            EventArg::Epoll => Self::Epoll,
        }
    }
}

/// The most `--batch` and `--signal` take: a doorbell's requests and a
/// signaling interval longer than any queue a tool makes.
pub const MAX_BATCH: usize = 4096;

/// Reactor flags every tool shares.
#[derive(Args, Debug, Clone)]
pub struct ReactorArgs {
    /// How the reactor waits for completions (default: per tool).
    #[arg(long, value_enum)]
    pub event_mode: Option<EventArg>,
    /// Signal every Nth send-queue request, 1 to 4096. The reactor lowers
    /// it to half a connection's send-queue depth.
    #[arg(long = "signal", default_value_t = 16, value_parser = range(1u32, MAX_BATCH as u32))]
    pub signal_interval: u32,
    /// Most requests per doorbell, 1 to 4096 (default: per tool).
    #[arg(long, value_parser = range(1usize, MAX_BATCH))]
    pub batch: Option<usize>,
    /// Repost consumed receives in batches of N, 1 to 64 (default: per
    /// tool). 1 reposts each at the end of the pass that consumed it. The
    /// reactor lowers it to half a connection's receive depth.
    #[arg(long, value_name = "N", value_parser = range(1u32, 64))]
    pub repost_batch: Option<u32>,
}

impl ReactorArgs {
    /// The chosen event mode, or the tool's default.
    pub fn event_mode_or(&self, default: EventArg) -> EventArg {
        self.event_mode.unwrap_or(default)
    }

    /// The chosen repost batch, or the tool's default.
    pub fn repost_batch_or(&self, default: u32) -> u32 {
        self.repost_batch.unwrap_or(default)
    }

    /// The chosen batch size, or the tool's default.
    pub fn batch_or(&self, default: usize) -> usize {
        self.batch.unwrap_or(default)
    }
}

/// How many reactors a tool runs, and where (`--reactors`, `--cores`).
#[derive(Args, Debug, Clone)]
pub struct RuntimeArgs {
    /// Reactor threads, each pinned to a core of its own (the NIC's NUMA
    /// node first).
    #[arg(long, default_value_t = 1, value_parser = range(1u16, u16::MAX))]
    pub reactors: u16,
    /// Pin reactor i to the i-th core of this list (e.g. 0,2 or 4-7)
    /// instead of choosing cores near the NIC.
    #[arg(long, value_name = "LIST")]
    pub cores: Option<String>,
}

impl RuntimeArgs {
    /// Checks the flags before anything is opened: `--cores` names at
    /// least one usable core per reactor, each once; pinned reactors
    /// (`unpinned` false) have a core each.
    pub fn check(&self, unpinned: bool) -> Result<(), Refusal> {
        let reactors = usize::from(self.reactors);
        if let Some(list) = &self.cores {
            core_list("--cores", list, reactors)?;
        } else if !unpinned {
            check_reactor_count("--reactors", reactors)?;
        }
        Ok(())
    }

    /// The core choice these flags make (`unpinned` when asked not to pin).
    pub fn core_choice(
        &self,
        unpinned: bool,
    ) -> Result<rdma_comm_core::runtime::CoreChoice, rdma_comm_core::Error> {
        use rdma_comm_core::runtime::{CoreChoice, parse_core_list};
        Ok(match (&self.cores, unpinned) {
            (_, true) => CoreChoice::Unpinned,
            (Some(list), false) => CoreChoice::List(parse_core_list(list)?),
            (None, false) => CoreChoice::NearDevice,
        })
    }
}

/// Checks that `reactors` pinned reactors (given as `argument`) have a
/// core each among those this process may run on.
pub fn check_reactor_count(argument: &str, reactors: usize) -> Result<(), Refusal> {
    let usable = rdma_comm_core::reactor::usable_cores().len();
    if usable > 0 && reactors > usable {
        return Err(Refusal::new(
            argument,
            reactors,
            format!(
                "must be 1 to {usable}: each pinned reactor needs a core of its own, and this process may use {usable}"
            ),
        ));
    }
    Ok(())
}

/// How sessions connect (the `--cm` flag).
#[derive(Args, Debug, Clone, Default)]
pub struct TransportArgs {
    /// Connect through the RDMA connection manager (rdma_cm) instead of
    /// TCP: the address is an RDMA interface's IP address and an rdma_cm
    /// port. Both ends need it.
    #[arg(long)]
    pub cm: bool,
}

impl TransportArgs {
    /// The session transport chosen.
    pub fn transport(&self) -> rdma_comm_core::session::Transport {
        if self.cm {
            rdma_comm_core::session::Transport::RdmaCm
        } else {
            rdma_comm_core::session::Transport::Tcp
        }
    }
}

/// Makes a tool's server print each handshake it refuses or loses as it
/// fails (`tool: rejected PEER: "WHY"`, escaped: a peer's words may be in
/// it): a client that gave up is explained on the server's side at once,
/// not only once (and if) the right peer arrives. A client whose handshake
/// was cut tries again, so a line here need not mean a failed run.
pub fn report_refusals(tool: &'static str, config: &mut rdma_comm_core::session::ServerConfig) {
    config.on_failure = Some(std::sync::Arc::new(move |failure| {
        eprintln!(
            "{tool}: rejected {}: {:?}",
            failure.peer,
            failure.error.to_string()
        )
    }));
}
