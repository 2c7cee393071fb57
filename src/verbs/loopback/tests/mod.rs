//! Unit tests of the loopback device through the verbs wrappers (which call
//! its functions exactly as they call a provider's): post and poll, RNR
//! queueing, access checks, flushes, CQ overflow and teardown in any order.
//! The helpers are here; the tests by theme in `data_path`, `faults` and
//! `lifecycle`.

use crate::Error;
use crate::verbs::{
    AccessFlags, CompletionQueue, Context, MemoryRegion, ProtectionDomain, QpConfig, QpState,
    QueuePair, RecvBatch, RecvRequest, WcOpcode, WcStatus, WorkCompletion, WorkRequest,
};

mod data_path;
mod faults;
mod lifecycle;
mod srq;

/// Two connected QPs on one CQ, granting `access` to each other.
fn pair(
    cq_size: u32,
    access: AccessFlags,
) -> (ProtectionDomain, CompletionQueue, QueuePair, QueuePair) {
    let ctx = single_threaded_context();
    let pd = ctx.alloc_pd().unwrap();
    let cq = ctx.create_cq(cq_size, None).unwrap();
    let (a, b) = connected(&pd, &cq, access);
    (pd, cq, a, b)
}

fn drain(cq: &mut CompletionQueue) -> Vec<WorkCompletion> {
    let mut all = Vec::new();
    let mut wcs = [WorkCompletion::default(); 8];
    loop {
        let got = cq.poll(&mut wcs).unwrap();
        if got.is_empty() {
            return all;
        }
        all.extend_from_slice(got);
    }
}

/// Every completion queued, as (wr_id, status).
fn statuses(cq: &mut CompletionQueue) -> Vec<(u64, WcStatus)> {
    drain(cq)
        .iter()
        .map(|wc| (wc.wr_id(), wc.status()))
        .collect()
}

fn bytes(mr: &MemoryRegion, offset: usize, len: usize) -> Vec<u8> {
    let mut out = vec![0; len];
    mr.read(offset, &mut out).unwrap();
    out
}

/// A context for a test whose one thread posts every request and reads
/// every byte.
fn single_threaded_context() -> Context {
    // SAFETY: each caller is a test whose one thread posts every request
    // and touches every registered byte.
    unsafe { Context::loopback() }
}

/// Two QPs of `pd` on `cq`, connected to each other.
fn connected(
    pd: &ProtectionDomain,
    cq: &CompletionQueue,
    access: AccessFlags,
) -> (QueuePair, QueuePair) {
    let config = QpConfig {
        remote_access: access,
        ..QpConfig::default()
    };
    let mut a = pd.create_qp(cq, cq, &config).unwrap();
    let mut b = pd.create_qp(cq, cq, &config).unwrap();
    link(&mut a, &mut b);
    (a, b)
}

/// Connects `a` and `b` to each other.
fn link(a: &mut QueuePair, b: &mut QueuePair) {
    let (ea, eb) = (a.endpoint(), b.endpoint());
    a.connect(&eb).unwrap();
    b.connect(&ea).unwrap();
}

/// Posts on `qp` a receive into the first 8 bytes of `mr` for each of `ids`.
fn post_recvs(qp: &mut QueuePair, mr: &MemoryRegion, ids: std::ops::Range<u64>) {
    for id in ids {
        qp.post_recv(&mut RecvRequest::new(id, mr.slice(0, 8).unwrap()).unwrap())
            .unwrap();
    }
}
