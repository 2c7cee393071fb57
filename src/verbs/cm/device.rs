//! Device contexts lent by librdmacm: an rdma_cm id is bound to the
//! library's own context of its device, and QPs for it must be made there.

use std::ptr::NonNull;

use crate::error::{CmFailure, Error, Result};
use crate::sys;

use super::super::Context;
use super::last_errno;

/// librdmacm's device list (`rdma_get_devices`), released on drop. While it
/// is held, the library keeps every context in it open: it closes a
/// device's context only once the device is gone and no list or id holds it.
struct DeviceList {
    list: NonNull<*mut sys::ibv_context>,
    len: usize,
}

// SAFETY: the list is only read after creation and freed once, in Drop;
// librdmacm serialises rdma_free_devices with its own lock.
unsafe impl Send for DeviceList {}
// SAFETY: see Send.
unsafe impl Sync for DeviceList {}

impl Drop for DeviceList {
    fn drop(&mut self) {
        // SAFETY: the list came from rdma_get_devices and is freed once.
        unsafe { sys::rdma_free_devices(self.list.as_ptr()) };
    }
}

impl DeviceList {
    fn get() -> Result<Self> {
        let mut len: libc::c_int = 0;
        // SAFETY: `len` is a valid out-pointer; the list is freed in Drop.
        let list = unsafe { sys::rdma_get_devices(&mut len) };
        let list = NonNull::new(list).ok_or_else(|| Error::Cm {
            op: "rdma_get_devices",
            peer: None,
            cause: CmFailure::Errno(last_errno()),
        })?;
        Ok(Self {
            list,
            len: usize::try_from(len).unwrap_or(0),
        })
    }

    fn contexts(&self) -> impl Iterator<Item = NonNull<sys::ibv_context>> + '_ {
        // SAFETY: the list holds `len` entries (then a NULL).
        (0..self.len).filter_map(|i| NonNull::new(unsafe { *self.list.as_ptr().add(i) }))
    }
}

/// A `Context` for `verbs`, a context librdmacm opened, kept open by a
/// device list the `Context` holds.
pub(super) fn lent_context(verbs: NonNull<sys::ibv_context>) -> Result<Context> {
    let devices = DeviceList::get()?;
    if !devices.contexts().any(|ctx| ctx == verbs) {
        return Err(Error::NoDevice(
            "for the rdma_cm id (its device was removed)".into(),
        ));
    }
    // SAFETY: the context is in the list, which stays open as long as the
    // list is held: the Context holds it and releases it last.
    Ok(unsafe { Context::lent(verbs, Box::new(devices)) })
}

/// librdmacm's context of the device called `name`: the one every rdma_cm
/// id bound to that device uses, so a PD and CQs made from it serve the QPs
/// of all of them (a server's shared PD). It stays open while the
/// `Context` or anything made from it lives.
pub fn open_device(name: &str) -> Result<Context> {
    let devices = DeviceList::get()?;
    let contexts: Vec<_> = devices.contexts().collect();
    let mut found = Vec::new();
    for ctx in contexts {
        // SAFETY: the context is open while the list is held.
        let device = unsafe { (*ctx.as_ptr()).device };
        // SAFETY: a live context's device has a NUL-terminated name.
        let this = unsafe { std::ffi::CStr::from_ptr(sys::ibv_get_device_name(device)) }
            .to_string_lossy()
            .into_owned();
        if this == name {
            // SAFETY: as in lent_context.
            return Ok(unsafe { Context::lent(ctx, Box::new(devices)) });
        }
        found.push(this);
    }
    let found = if found.is_empty() {
        "none".into()
    } else {
        found.join(", ")
    };
    Err(Error::NoDevice(format!(
        "named {name:?} for the connection manager (found: {found})"
    )))
}
