//! What the reactor's QPs are built from: specs whose QPs report to its
//! CQs (taken in turn) and its SRQ, with its queue depths, for the
//! session layer, a server, or a pair connected in one process. `add`
//! takes only QPs built this way.

use crate::error::Result;
use crate::session::{CqChoice, QpSpec, ServerConfig};
use crate::verbs::{AccessFlags, ProtectionDomain, QpConfig, QueuePair};

use super::conn::MIN_RECV_DEPTH;
use super::srq_pool::SrqPool;
use super::{Handler, PeerLink, Reactor};

impl<H: Handler, L: PeerLink> Reactor<H, L> {
    /// A QP spec whose QP reports to this reactor's CQs (spread over them
    /// round-robin) with queue depths matching the reactor's settings.
    pub fn qp_spec(&mut self, name: impl Into<String>) -> QpSpec {
        let cq = self.completions.next_shared();
        let qp = QpConfig {
            max_send_wr: self.config.sq_depth,
            max_recv_wr: self.config.recv_depth.max(MIN_RECV_DEPTH),
            max_inline_data: self.config.max_inline,
            ..QpConfig::default()
        };
        QpSpec {
            name: name.into(),
            cq: CqChoice::Shared(cq),
            qp,
            srq: self.srq.as_ref().map(SrqPool::attachment),
        }
    }

    /// Like [`qp_spec`](Self::qp_spec), also letting the peer WRITE
    /// and/or READ the regions this side exports.
    pub fn qp_spec_with_access(
        &mut self,
        name: impl Into<String>,
        remote_access: AccessFlags,
    ) -> QpSpec {
        let mut spec = self.qp_spec(name);
        spec.qp.remote_access = remote_access;
        spec
    }

    /// Two QPs of `pd` on this reactor's CQs (and its shared receive
    /// queue, if it has one), granting `access`, connected to each other:
    /// add each as a session of its own with `reactor.add(vec![qp], ..)`.
    /// Both ends in one process, on one device: what a test or a benchmark
    /// over [`Context::loopback`](crate::verbs::Context::loopback) (or one
    /// real device) needs, with no session layer.
    pub fn connected_pair(
        &mut self,
        pd: &ProtectionDomain,
        access: AccessFlags,
    ) -> Result<(QueuePair, QueuePair)> {
        let mut qp = |name: &str| {
            let spec = self.qp_spec_with_access(name, access);
            let CqChoice::Shared(cq) = spec.cq else {
                unreachable!("qp_spec always shares the reactor's CQs")
            };
            match &spec.srq {
                Some(srq) => pd.create_qp_with_srq(&cq, &cq, srq, &spec.qp),
                None => pd.create_qp(&cq, &cq, &spec.qp),
            }
        };
        let (mut a, mut b) = (qp("a")?, qp("b")?);
        let (to_a, to_b) = (a.endpoint(), b.endpoint());
        a.connect(&to_b)?;
        b.connect(&to_a)?;
        Ok((a, b))
    }

    /// A server configuration whose QPs report to this reactor (spread
    /// over its CQs, peer by peer), with `remote_access` granted to peers.
    /// Like [`ServerConfig::default`] it has no key: set `auth_key` (or
    /// `insecure_open`) before binding.
    pub fn server_config(&mut self, remote_access: AccessFlags) -> ServerConfig {
        let spec = self.qp_spec_with_access("", remote_access);
        // Accepted peers take the reactor's CQs in turn, as `qp_spec`
        // callers do: one CQ would cap a server at what it can absorb.
        let cq = self.completions.spread().map_or(spec.cq, CqChoice::Spread);
        ServerConfig {
            qp: spec.qp,
            cq,
            srq: spec.srq,
            ..ServerConfig::default()
        }
    }
}
