//! A datagram request borrows the region its payload is in: the region
//! cannot be dropped while the request exists.
use rdma_comm_core::verbs::*;

fn main() -> rdma_comm_core::Result<()> {
    let ctx = Context::open_default(None)?;
    let pd = ctx.alloc_pd()?;
    let cq = ctx.create_cq(16, None)?;
    let mut qp = pd.create_ud_qp(&cq, &cq, &UdConfig::default())?;
    let mr = pd.alloc_mr(64, AccessFlags::empty())?;
    let to = qp.destination(&qp.endpoint())?;
    let mut request = UdSend::new(1, mr.slice(0, 8)?, &to);
    drop(mr);
    qp.post_send(&mut request)?;
    Ok(())
}
