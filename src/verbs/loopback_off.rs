//! The loopback device's entry points when the `loopback` feature is off.
//!
//! Without the feature no loopback context exists: `Context::loopback` is
//! not compiled and `ContextInner::is_loopback` is a constant `false`, so
//! the verbs' `if is_loopback()` branches are dead and the compiler drops
//! them. These keep those call sites free of `cfg`; none can run.

// The parameters mirror the real device's functions.
#![allow(unused_variables)]

use std::os::raw::c_int;
use std::ptr::NonNull;
use std::sync::Arc;

use crate::error::Error;
use crate::sys;

/// Why none of these can run.
const ABSENT: &str = "no loopback context exists without the `loopback` feature";

pub(crate) fn device_attr() -> sys::ibv_device_attr {
    unreachable!("{ABSENT}")
}

pub(crate) fn port_attr(port: u8) -> Result<sys::ibv_port_attr, c_int> {
    unreachable!("{ABSENT}")
}

pub(crate) fn gid_table(port: u8) -> Vec<sys::ibv_gid_entry> {
    unreachable!("{ABSENT}")
}

pub(crate) fn unsupported(verb: &'static str, device: &Arc<str>) -> Error {
    unreachable!("{ABSENT}")
}

pub(crate) fn create_cq(
    ctx: NonNull<sys::ibv_context>,
    cqe: u32,
) -> Result<NonNull<sys::ibv_cq>, c_int> {
    unreachable!("{ABSENT}")
}

pub(crate) unsafe fn destroy_cq(cq: NonNull<sys::ibv_cq>) {
    unreachable!("{ABSENT}")
}

pub(crate) fn alloc_pd(ctx: NonNull<sys::ibv_context>) -> NonNull<sys::ibv_pd> {
    unreachable!("{ABSENT}")
}

pub(crate) unsafe fn dealloc_pd(pd: NonNull<sys::ibv_pd>) {
    unreachable!("{ABSENT}")
}

pub(crate) unsafe fn reg_mr(
    pd: NonNull<sys::ibv_pd>,
    addr: *mut u8,
    len: usize,
    access: u32,
) -> Result<NonNull<sys::ibv_mr>, c_int> {
    unreachable!("{ABSENT}")
}

pub(crate) unsafe fn dereg_mr(mr: NonNull<sys::ibv_mr>) {
    unreachable!("{ABSENT}")
}

pub(crate) unsafe fn create_srq(
    pd: NonNull<sys::ibv_pd>,
    init: &mut sys::ibv_srq_init_attr,
) -> Result<NonNull<sys::ibv_srq>, c_int> {
    unreachable!("{ABSENT}")
}

pub(crate) unsafe fn destroy_srq(srq: NonNull<sys::ibv_srq>) {
    unreachable!("{ABSENT}")
}

pub(crate) unsafe fn create_qp(
    pd: NonNull<sys::ibv_pd>,
    init: &mut sys::ibv_qp_init_attr,
) -> Result<NonNull<sys::ibv_qp>, c_int> {
    unreachable!("{ABSENT}")
}

pub(crate) unsafe fn destroy_qp(qp: NonNull<sys::ibv_qp>) {
    unreachable!("{ABSENT}")
}

pub(crate) unsafe fn modify_qp(
    qp: NonNull<sys::ibv_qp>,
    attr: &sys::ibv_qp_attr,
    mask: u32,
) -> c_int {
    unreachable!("{ABSENT}")
}

pub(crate) unsafe fn query_qp_state(qp: NonNull<sys::ibv_qp>) -> sys::ibv_qp_state {
    unreachable!("{ABSENT}")
}
