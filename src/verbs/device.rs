//! Devices, ports and GIDs: finding and opening an RDMA device.

use std::any::Any;
use std::ffi::CStr;
use std::fmt;
use std::net::Ipv4Addr;
use std::ptr::NonNull;
use std::sync::Arc;

use crate::error::{Error, Result};
use crate::sys;

use super::{check_ptr, check_rc, loopback};

/// Names of the RDMA devices on this host, in libibverbs order.
///
/// An empty list is not an error: the caller decides whether that is fatal.
///
/// ```no_run
/// for name in rdma_comm_core::verbs::devices()? {
///     println!("{name}");
/// }
/// # Ok::<(), rdma_comm_core::Error>(())
/// ```
pub fn devices() -> Result<Vec<String>> {
    let list = DeviceList::get()?;
    Ok(list.iter().map(|dev| device_name(dev.as_ptr())).collect())
}

/// The `ibv_get_device_list` array, freed on drop.
struct DeviceList {
    /// NULL when the kernel has no RDMA support at all (an empty list).
    devices: *mut *mut sys::ibv_device,
    len: usize,
}

impl DeviceList {
    fn get() -> Result<Self> {
        let mut len = 0;
        // SAFETY: `len` is a valid out-pointer; the returned array is owned by
        // this DeviceList and freed exactly once in Drop.
        let devices = unsafe { sys::ibv_get_device_list(&mut len) };
        if devices.is_null() {
            let err = std::io::Error::last_os_error();
            // ENOSYS: the kernel has no uverbs support, which for the caller is
            // the same as having no device.
            if err.raw_os_error() != Some(libc::ENOSYS) {
                return Err(Error::Os {
                    what: "ibv_get_device_list",
                    source: err,
                });
            }
            len = 0;
        }
        Ok(Self {
            devices,
            len: len.max(0) as usize,
        })
    }

    fn iter(&self) -> impl Iterator<Item = NonNull<sys::ibv_device>> + '_ {
        // SAFETY: libibverbs guarantees `len` valid entries when the list is non-NULL
        // (len is 0 otherwise).
        (0..self.len).filter_map(move |i| NonNull::new(unsafe { *self.devices.add(i) }))
    }
}

impl Drop for DeviceList {
    fn drop(&mut self) {
        if !self.devices.is_null() {
            // SAFETY: the pointer came from ibv_get_device_list and is freed once.
            unsafe { sys::ibv_free_device_list(self.devices) };
        }
    }
}

fn device_name(dev: *mut sys::ibv_device) -> String {
    // SAFETY: `dev` is a live entry of a device list; its name is a NUL-terminated
    // string owned by libibverbs for the life of the list.
    unsafe { CStr::from_ptr(sys::ibv_get_device_name(dev)) }
        .to_string_lossy()
        .into_owned()
}

/// The open device; closed when the last object using it is dropped.
pub(crate) struct ContextInner {
    pub(crate) ctx: NonNull<sys::ibv_context>,
    pub(crate) name: Arc<str>,
    owner: Owner,
}

/// Who closes a device context.
enum Owner {
    /// We opened it with `ibv_open_device`, so `Drop` closes it.
    Opened,
    /// Another library opened it and lent it to us (librdmacm's context of
    /// the device an rdma_cm id is bound to): the guard keeps it open until
    /// it is dropped, after every object created from it.
    Lent(#[allow(dead_code)] Box<dyn Any + Send + Sync>),
    /// The in-process software device ([`Context::loopback`]): its objects
    /// are this crate's own (`verbs::loopback`), not libibverbs'.
    #[cfg(feature = "loopback")]
    Loopback,
}

impl ContextInner {
    /// True for a [`Context::loopback`] context, whose set-up and teardown
    /// verbs are served by `verbs::loopback` instead of libibverbs.
    #[inline]
    pub(crate) fn is_loopback(&self) -> bool {
        #[cfg(feature = "loopback")]
        return matches!(self.owner, Owner::Loopback);
        #[cfg(not(feature = "loopback"))]
        return false;
    }
}

// SAFETY: libibverbs contexts are thread-safe; the pointer is only freed in Drop,
// after every child (which holds an Arc to this) is gone, by us or (a lent
// context) by its owner once the guard, dropped last, lets it.
unsafe impl Send for ContextInner {}
// SAFETY: see Send; all verbs taking a context may be called concurrently.
unsafe impl Sync for ContextInner {}

impl Drop for ContextInner {
    fn drop(&mut self) {
        match self.owner {
            // Its owner closes it; the guard is released after this body,
            // and every child (which holds an Arc to us) is gone already.
            Owner::Lent(_) => return,
            #[cfg(feature = "loopback")]
            Owner::Loopback => {
                // SAFETY: allocated by loopback::open_context and freed only
                // here; every child holds an Arc to us, so none is alive.
                unsafe { loopback::close_context(self.ctx) };
                return;
            }
            Owner::Opened => {}
        }
        // SAFETY: every child object holds an Arc to us, so none is alive now.
        let rc = unsafe { sys::ibv_close_device(self.ctx.as_ptr()) };
        if let Err(err) = check_rc(rc, "ibv_close_device", &self.name, None) {
            log::error!("{err}");
        }
    }
}

/// An open RDMA device.
///
/// Cheap to clone; the device closes when the last clone and the last object
/// created from it are dropped.
///
/// ```no_run
/// use rdma_comm_core::verbs::Context;
/// let ctx = Context::open_default(None)?; // first device with an active port
/// let port = ctx.query_port(1)?;
/// let gid = ctx.select_gid(1, None)?;
/// println!("{} port 1: {:?}, MTU {}, GID[{}] {}", ctx.name(), port.state, port.active_mtu.bytes(), gid.index, gid.gid);
/// # Ok::<(), rdma_comm_core::Error>(())
/// ```
#[derive(Clone)]
pub struct Context {
    pub(crate) inner: Arc<ContextInner>,
}

impl fmt::Debug for Context {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Context")
            .field("device", &self.name())
            .finish()
    }
}

impl Context {
    /// Opens the device called `name` (e.g. `mlx5_0`, `rxe0`).
    pub fn open(name: &str) -> Result<Self> {
        let list = DeviceList::get()?;
        let dev = list
            .iter()
            .find(|dev| device_name(dev.as_ptr()) == name)
            .ok_or_else(|| {
                Error::NoDevice(format!("named {name:?} (found: {})", names_or_none(&list)))
            })?;
        Self::open_raw(dev, name)
    }

    /// Opens `name` if given, otherwise the first device that has an active port.
    pub fn open_default(name: Option<&str>) -> Result<Self> {
        match name {
            Some(name) => Self::open(name),
            None => Self::open_first_active(),
        }
    }

    /// Opens the first device with at least one port in the ACTIVE state.
    pub fn open_first_active() -> Result<Self> {
        let list = DeviceList::get()?;
        for dev in list.iter() {
            let name = device_name(dev.as_ptr());
            let Ok(ctx) = Self::open_raw(dev, &name) else {
                continue;
            };
            if ctx.first_active_port().is_ok() {
                return Ok(ctx);
            }
        }
        Err(Error::NoDevice(format!(
            "with an active port (found: {})",
            names_or_none(&list)
        )))
    }

    fn open_raw(dev: NonNull<sys::ibv_device>, name: &str) -> Result<Self> {
        let name: Arc<str> = Arc::from(name);
        // SAFETY: `dev` is a live device-list entry; the context outlives the list.
        let ctx = check_ptr(
            unsafe { sys::ibv_open_device(dev.as_ptr()) },
            "ibv_open_device",
            &name,
        )?;
        Ok(Self {
            inner: Arc::new(ContextInner {
                ctx,
                name,
                owner: Owner::Opened,
            }),
        })
    }

    /// Opens a new context of the in-process software device `loopback`:
    /// no NIC, no kernel support and no libibverbs device are involved.
    ///
    /// It has one port, 1, always ACTIVE (Ethernet link layer, MTU 4096),
    /// with one GID at index 0: the IPv4-mapped `::ffff:127.0.0.1`
    /// (RoCE v2). Reliable-connected QPs of any loopback context in the
    /// process can connect to one another ([`QueuePair::connect`](super::QueuePair::connect)
    /// finds the peer by its QP number), and work requests execute
    /// synchronously inside the post call: a SEND lands in the peer's
    /// oldest receive (or waits for the next one, as RNR retries forever
    /// would), WRITE and READ copy between memory registered on loopback
    /// contexts with the key, range and access checks a NIC makes, and the
    /// completions are on the CQs when the post returns. It exists so that
    /// tests and benchmarks of everything above the verbs (the reactor's
    /// staging, doorbell bookkeeping and completion dispatch) run on any
    /// machine; what it costs per request (a few uncontended locks and a
    /// `memcpy`) is part of what a benchmark over it measures. Built with
    /// the `loopback` feature (on by default).
    ///
    /// # Safety
    /// A NIC's DMA is outside the program, so this crate lets Rust code
    /// read and write registered memory while requests may use it (the
    /// bytes may tear, nothing worse). The loopback device's "DMA" is a
    /// copy made by the thread that posts, inside the post call, so the
    /// caller must rule out the data race: while a post on one thread may
    /// copy into or out of registered bytes (those of its own gather list,
    /// the peer's posted receive, the remote range of a WRITE or READ), no
    /// other thread may access those bytes. Serving every QP of the
    /// loopback device from one thread satisfies this, as does touching a
    /// region's bytes only after the completions that end the requests
    /// using it (a completion polled from a CQ follows its copy).
    ///
    /// Shared receive queues are served (an SRQ has no limit event). Not
    /// supported ([`Error::Unsupported`]): completion channels and
    /// `req_notify` (busy polling only), memory windows and the connection
    /// manager. Where it differs from a NIC: a
    /// request to a QP that is not connected back to the sender (not yet,
    /// or to another QP) fails at once with `IBV_WC_RETRY_EXC_ERR`, where a
    /// NIC would retry for `timeout` × `retry_cnt` first, so connect both
    /// ends before posting; QP numbers, keys and handles are process-wide
    /// counters, meant for tests and benchmarks, not for billions of
    /// objects.
    ///
    /// ```
    /// use rdma_comm_core::verbs::*;
    /// // SAFETY: one thread posts every request and touches every byte.
    /// let ctx = unsafe { Context::loopback() };
    /// let pd = ctx.alloc_pd()?;
    /// let mut cq = ctx.create_cq(16, None)?;
    /// let mut a = pd.create_qp(&cq, &cq, &QpConfig::default())?;
    /// let mut b = pd.create_qp(&cq, &cq, &QpConfig::default())?;
    /// let (ea, eb) = (a.endpoint(), b.endpoint());
    /// a.connect(&eb)?;
    /// b.connect(&ea)?;
    /// let mut mr = pd.alloc_mr(64, AccessFlags::LOCAL_WRITE)?;
    /// mr.write(0, b"hello")?;
    /// b.post_recv(&mut RecvRequest::new(1, mr.slice(32, 32)?)?)?;
    /// a.post_send(&mut WorkRequest::send(2, mr.slice(0, 5)?).signaled())?;
    /// let mut wcs = [WorkCompletion::default(); 4];
    /// assert_eq!(cq.poll(&mut wcs)?.len(), 2); // the RECV and the SEND
    /// let mut got = [0u8; 5];
    /// mr.read(32, &mut got)?;
    /// assert_eq!(&got, b"hello");
    /// # Ok::<(), rdma_comm_core::Error>(())
    /// ```
    #[cfg(feature = "loopback")]
    pub unsafe fn loopback() -> Self {
        Self {
            inner: Arc::new(ContextInner {
                ctx: loopback::open_context(),
                name: Arc::from(loopback::DEVICE_NAME),
                owner: Owner::Loopback,
            }),
        }
    }

    /// True for a context of the in-process software device
    /// ([`Context::loopback`]).
    pub fn is_loopback(&self) -> bool {
        self.inner.is_loopback()
    }

    /// Wraps a device context another library opened, which this `Context`
    /// must never close.
    ///
    /// # Safety
    /// `ctx` must be an open device context that stays open, and is closed
    /// by nobody, for as long as `keep_open` is alive.
    #[cfg_attr(not(feature = "rdma_cm"), allow(dead_code))]
    pub(crate) unsafe fn lent(
        ctx: NonNull<sys::ibv_context>,
        keep_open: Box<dyn Any + Send + Sync>,
    ) -> Self {
        // SAFETY: the caller vouches that the context is open; its device
        // pointer and name live as long as it does.
        let name = device_name(unsafe { (*ctx.as_ptr()).device });
        Self {
            inner: Arc::new(ContextInner {
                ctx,
                name: Arc::from(name),
                owner: Owner::Lent(keep_open),
            }),
        }
    }

    /// True if this context was lent by the connection manager
    /// ([`cm`](super::cm)) rather than opened by [`Context::open`].
    pub fn is_lent(&self) -> bool {
        matches!(self.inner.owner, Owner::Lent(_))
    }

    /// True if both handles are the very same device context (not merely
    /// the same device: each [`Context::open`] opens a context of its own).
    /// Objects of one context cannot be used with another's.
    pub fn same_context(&self, other: &Context) -> bool {
        self.inner.ctx == other.inner.ctx
    }

    /// The device name.
    pub fn name(&self) -> &str {
        &self.inner.name
    }

    /// Device-wide limits.
    pub fn query_device(&self) -> Result<DeviceAttr> {
        let mut attr = sys::ibv_device_attr::default();
        if self.inner.is_loopback() {
            attr = loopback::device_attr();
        } else {
            // SAFETY: the context is open and `attr` is a valid out-pointer.
            let rc = unsafe { sys::ibv_query_device(self.inner.ctx.as_ptr(), &mut attr) };
            check_rc(rc, "ibv_query_device", &self.inner.name, None)?;
        }
        Ok(DeviceAttr {
            phys_port_cnt: attr.phys_port_cnt,
            max_qp_wr: attr.max_qp_wr.max(0) as u32,
            max_sge: attr.max_sge.max(0) as u32,
            max_cqe: attr.max_cqe.max(0) as u32,
            max_mr_size: attr.max_mr_size,
            max_qp_rd_atom: attr.max_qp_rd_atom.clamp(0, 255) as u8,
            max_qp_init_rd_atom: attr.max_qp_init_rd_atom.clamp(0, 255) as u8,
            max_mw: attr.max_mw.max(0) as u32,
            mem_window_type2: attr.device_cap_flags
                & (sys::IBV_DEVICE_MEM_WINDOW_TYPE_2A | sys::IBV_DEVICE_MEM_WINDOW_TYPE_2B)
                != 0,
        })
    }

    /// State, MTU, link layer and LID of a port (ports are numbered from 1).
    pub fn query_port(&self, port: u8) -> Result<PortAttr> {
        let mut attr = sys::ibv_port_attr::default();
        let rc = if self.inner.is_loopback() {
            loopback::port_attr(port).map_or_else(
                |errno| errno,
                |port| {
                    attr = port;
                    0
                },
            )
        } else {
            // SAFETY: the context is open and `attr` is a valid out-pointer of the
            // header's current layout (the inline wrapper passes its size).
            unsafe { sys::___ibv_query_port(self.inner.ctx.as_ptr(), port, &mut attr) }
        };
        check_rc(rc, "ibv_query_port", &self.inner.name, None)?;
        Ok(PortAttr {
            state: PortState::from_raw(attr.state),
            max_mtu: Mtu::from_raw(attr.max_mtu),
            active_mtu: Mtu::from_raw(attr.active_mtu),
            link_layer: LinkLayer::from_raw(attr.link_layer),
            lid: attr.lid,
            gid_table_len: attr.gid_tbl_len.max(0) as u32,
            max_msg_size: attr.max_msg_sz,
        })
    }

    /// The first port in the ACTIVE state.
    pub fn first_active_port(&self) -> Result<u8> {
        let ports = self.query_device()?.phys_port_cnt;
        (1..=ports)
            .find(|&p| matches!(self.query_port(p), Ok(attr) if attr.state == PortState::Active))
            .ok_or_else(|| Error::Port {
                device: Arc::clone(&self.inner.name),
                port: 1,
                reason: format!("none of {ports} port(s) is ACTIVE"),
            })
    }

    /// The populated entries of a port's GID table.
    pub fn gid_table(&self, port: u8) -> Result<Vec<GidEntry>> {
        let len = self.query_port(port)?.gid_table_len as usize;
        if self.inner.is_loopback() {
            return Ok(Self::gid_entries(&loopback::gid_table(port)));
        }
        let ports = usize::from(self.query_device()?.phys_port_cnt.max(1));
        // One call for the whole table: asking entry by entry costs a system
        // call for every empty slot (rxe has 1024 of them per port).
        let mut raw = vec![sys::ibv_gid_entry::default(); len * ports];
        // SAFETY: the context is open and `raw` has room for `raw.len()` entries.
        let found = unsafe {
            sys::ibv_query_gid_table(self.inner.ctx.as_ptr(), raw.as_mut_ptr(), raw.len(), 0)
        };
        let raw = match usize::try_from(found) {
            Ok(found) => {
                raw.truncate(found);
                raw.retain(|entry| entry.port_num == u32::from(port));
                raw
            }
            // Kernels without the table query: one entry at a time.
            Err(_) => self.gid_entries_one_by_one(port, len),
        };
        Ok(Self::gid_entries(&raw))
    }

    /// The populated entries of a raw table, by index.
    fn gid_entries(raw: &[sys::ibv_gid_entry]) -> Vec<GidEntry> {
        let mut entries: Vec<GidEntry> = raw
            .iter()
            .filter_map(|entry| {
                // SAFETY: `raw` covers the whole 16-byte union.
                let gid = Gid(unsafe { entry.gid.raw });
                (!gid.is_zero()).then(|| GidEntry {
                    index: entry.gid_index,
                    gid,
                    gid_type: GidType::from_raw(entry.gid_type),
                })
            })
            .collect();
        entries.sort_by_key(|entry| entry.index);
        entries
    }

    fn gid_entries_one_by_one(&self, port: u8, len: usize) -> Vec<sys::ibv_gid_entry> {
        (0..len as u32)
            .filter_map(|index| {
                let mut entry = sys::ibv_gid_entry::default();
                // SAFETY: the context is open and `entry` is a valid out-pointer.
                let rc = unsafe {
                    sys::ibv_query_gid_ex(
                        self.inner.ctx.as_ptr(),
                        port as u32,
                        index,
                        &mut entry,
                        0,
                    )
                };
                // Unpopulated slots report ENODATA (or EINVAL on older kernels).
                (rc == 0).then_some(entry)
            })
            .collect()
    }

    /// Picks the GID to address this port with.
    ///
    /// With `index`, that entry (it must exist). Otherwise, on Ethernet (RoCE)
    /// the first RoCE v2 IPv4-mapped GID, then any RoCE v2 GID, then any GID; on
    /// InfiniBand, index 0.
    pub fn select_gid(&self, port: u8, index: Option<u32>) -> Result<GidEntry> {
        let table = self.gid_table(port)?;
        let no_gid = |reason: String| Error::Port {
            device: Arc::clone(&self.inner.name),
            port,
            reason,
        };
        if let Some(index) = index {
            return table
                .into_iter()
                .find(|e| e.index == index)
                .ok_or_else(|| no_gid(format!("GID index {index} is not populated")));
        }
        let roce_v2 = |e: &&GidEntry| e.gid_type == GidType::RoceV2;
        table
            .iter()
            .filter(roce_v2)
            .find(|e| e.gid.ipv4_mapped().is_some())
            .or_else(|| table.iter().find(roce_v2))
            .or_else(|| table.first())
            .copied()
            .ok_or_else(|| {
                no_gid("the GID table is empty (is the netdev up with an address?)".into())
            })
    }
}

fn names_or_none(list: &DeviceList) -> String {
    let names: Vec<String> = list.iter().map(|d| device_name(d.as_ptr())).collect();
    if names.is_empty() {
        "none".into()
    } else {
        names.join(", ")
    }
}

/// Device-wide limits from `ibv_query_device`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct DeviceAttr {
    /// Number of physical ports.
    pub phys_port_cnt: u8,
    /// Maximum work requests per queue.
    pub max_qp_wr: u32,
    /// Maximum scatter/gather entries per work request.
    pub max_sge: u32,
    /// Maximum entries per completion queue.
    pub max_cqe: u32,
    /// Largest registrable memory region.
    pub max_mr_size: u64,
    /// Maximum outstanding RDMA READs a QP can serve as a target.
    pub max_qp_rd_atom: u8,
    /// Maximum outstanding RDMA READs a QP can initiate.
    pub max_qp_init_rd_atom: u8,
    /// Maximum memory windows.
    pub max_mw: u32,
    /// True if the device has type-2 memory windows (2A or 2B), which
    /// [`ProtectionDomain::alloc_mw`](super::ProtectionDomain::alloc_mw) allocates.
    pub mem_window_type2: bool,
}

/// What `ibv_query_port` reports that connection set-up needs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct PortAttr {
    /// Logical port state.
    pub state: PortState,
    /// Largest MTU the port supports.
    pub max_mtu: Mtu,
    /// MTU currently in force; connections are clamped to it.
    pub active_mtu: Mtu,
    /// InfiniBand or Ethernet (RoCE).
    pub link_layer: LinkLayer,
    /// Local identifier (InfiniBand only; 0 on RoCE).
    pub lid: u16,
    /// Size of the GID table.
    pub gid_table_len: u32,
    /// Largest message the port can carry.
    pub max_msg_size: u32,
}

/// Logical port state.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[allow(missing_docs)]
pub enum PortState {
    Down,
    Init,
    Armed,
    Active,
    ActiveDefer,
    Unknown(u32),
}

impl PortState {
    fn from_raw(raw: sys::ibv_port_state) -> Self {
        match raw {
            sys::IBV_PORT_DOWN => Self::Down,
            sys::IBV_PORT_INIT => Self::Init,
            sys::IBV_PORT_ARMED => Self::Armed,
            sys::IBV_PORT_ACTIVE => Self::Active,
            sys::IBV_PORT_ACTIVE_DEFER => Self::ActiveDefer,
            other => Self::Unknown(other),
        }
    }
}

/// Path MTU.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
#[allow(missing_docs)]
pub enum Mtu {
    Mtu256 = 1,
    Mtu512 = 2,
    Mtu1024 = 3,
    Mtu2048 = 4,
    Mtu4096 = 5,
}

impl Mtu {
    /// From the verbs enum value (1..=5); unknown values map to 1024, the
    /// smallest MTU every RoCE and IB fabric carries.
    pub fn from_raw(raw: u32) -> Self {
        match raw {
            1 => Self::Mtu256,
            2 => Self::Mtu512,
            4 => Self::Mtu2048,
            5 => Self::Mtu4096,
            _ => Self::Mtu1024,
        }
    }

    /// From a byte count (256, 512, 1024, 2048 or 4096).
    pub fn from_bytes(bytes: u32) -> Option<Self> {
        [
            Self::Mtu256,
            Self::Mtu512,
            Self::Mtu1024,
            Self::Mtu2048,
            Self::Mtu4096,
        ]
        .into_iter()
        .find(|m| m.bytes() == bytes)
    }

    /// The verbs enum value.
    pub fn to_raw(self) -> u32 {
        self as u32
    }

    /// The MTU in bytes.
    pub fn bytes(self) -> u32 {
        128 << (self as u32)
    }
}

/// The port's link layer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[allow(missing_docs)]
pub enum LinkLayer {
    InfiniBand,
    Ethernet,
    Unspecified,
}

impl LinkLayer {
    fn from_raw(raw: u8) -> Self {
        match u32::from(raw) {
            sys::IBV_LINK_LAYER_INFINIBAND => Self::InfiniBand,
            sys::IBV_LINK_LAYER_ETHERNET => Self::Ethernet,
            _ => Self::Unspecified,
        }
    }
}

/// A 128-bit global identifier, in network byte order.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct Gid(pub [u8; 16]);

impl Gid {
    /// True for the all-zero GID (an unpopulated table slot).
    pub fn is_zero(&self) -> bool {
        self.0 == [0; 16]
    }

    /// The IPv4-mapped GID of `addr` (`::ffff:a.b.c.d`): a RoCE v2 port's
    /// GID for an IPv4 address, or a multicast group's for a multicast one.
    pub fn from_ipv4(addr: Ipv4Addr) -> Self {
        let mut raw = [0; 16];
        raw[10] = 0xff;
        raw[11] = 0xff;
        raw[12..].copy_from_slice(&addr.octets());
        Gid(raw)
    }

    /// The IPv4 address of an IPv4-mapped GID (`::ffff:a.b.c.d`).
    pub fn ipv4_mapped(&self) -> Option<Ipv4Addr> {
        let [prefix @ .., a, b, c, d] = self.0;
        (prefix[..10] == [0; 10] && prefix[10..] == [0xff, 0xff]).then(|| Ipv4Addr::new(a, b, c, d))
    }
}

impl fmt::Display for Gid {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.ipv4_mapped() {
            Some(v4) => write!(f, "::ffff:{v4}"),
            None => fmt::Display::fmt(&std::net::Ipv6Addr::from(self.0), f),
        }
    }
}

impl fmt::Debug for Gid {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Gid({self})")
    }
}

/// How a GID table entry is used on the wire.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[allow(missing_docs)]
pub enum GidType {
    InfiniBand,
    RoceV1,
    RoceV2,
    Unknown(u32),
}

impl GidType {
    fn from_raw(raw: u32) -> Self {
        match raw {
            sys::IBV_GID_TYPE_IB => Self::InfiniBand,
            sys::IBV_GID_TYPE_ROCE_V1 => Self::RoceV1,
            sys::IBV_GID_TYPE_ROCE_V2 => Self::RoceV2,
            other => Self::Unknown(other),
        }
    }
}

/// One populated GID table entry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GidEntry {
    /// Index in the port's GID table (`sgid_index`).
    pub index: u32,
    /// The GID itself.
    pub gid: Gid,
    /// IB, RoCE v1 or RoCE v2.
    pub gid_type: GidType,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ipv4_mapped_gid_is_recognised() {
        let mut raw = [0u8; 16];
        raw[10] = 0xff;
        raw[11] = 0xff;
        raw[12..].copy_from_slice(&[10, 77, 0, 1]);
        let gid = Gid(raw);
        assert_eq!(gid.ipv4_mapped(), Some(Ipv4Addr::new(10, 77, 0, 1)));
        assert_eq!(gid.to_string(), "::ffff:10.77.0.1");
        raw[0] = 0xfe;
        raw[1] = 0x80;
        assert_eq!(Gid(raw).ipv4_mapped(), None);
    }

    #[test]
    fn mtu_round_trips() {
        for bytes in [256, 512, 1024, 2048, 4096] {
            let mtu = Mtu::from_bytes(bytes).unwrap();
            assert_eq!(mtu.bytes(), bytes);
            assert_eq!(Mtu::from_raw(mtu.to_raw()), mtu);
        }
        assert_eq!(Mtu::from_bytes(1500), None);
        assert_eq!(Mtu::from_raw(sys::IBV_MTU_4096), Mtu::Mtu4096);
        assert_eq!(Mtu::from_raw(sys::IBV_MTU_256), Mtu::Mtu256);
    }
}
