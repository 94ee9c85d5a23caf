//! Devices, opened contexts, device and port attributes, and the GID table.

use std::ffi::CStr;
use std::fmt;
use std::net::{Ipv4Addr, Ipv6Addr};
use std::path::PathBuf;
use std::ptr::NonNull;
use std::sync::Arc;

use rdma_sys as sys;

use super::cq::{CompletionChannel, CompletionQueue};
use super::error::{check_code, Error, Result};
use super::pd::ProtectionDomain;

/// Environment variable that overrides the GID index chosen by
/// [`Context::default_gid_index`].
pub const GID_INDEX_ENV: &str = "SNOWRDMA_GID_INDEX";
/// Environment variable naming the device [`Context::open`] picks when given
/// no name.
pub const DEVICE_ENV: &str = "SNOWRDMA_DEVICE";

/// One RDMA device present on this host.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceInfo {
    /// Kernel name, e.g. `mlx5_0` or `rxe0`.
    pub name: String,
    /// Node GUID in host byte order.
    pub guid: u64,
}

/// Lists the RDMA devices on this host; an empty list when there are none.
pub fn devices() -> Result<Vec<DeviceInfo>> {
    let mut n = 0;
    // SAFETY: ibv_get_device_list returns an array of n pointers, or NULL.
    let list = unsafe { sys::ibv_get_device_list(&mut n) };
    if list.is_null() {
        // ENOSYS means the kernel has no RDMA support at all: no devices.
        let err = std::io::Error::last_os_error();
        return match err.raw_os_error() {
            Some(libc::ENOSYS) => Ok(Vec::new()),
            _ => Err(Error::Verb {
                verb: "ibv_get_device_list",
                source: err,
            }),
        };
    }
    let mut out = Vec::with_capacity(n as usize);
    for i in 0..n as usize {
        // SAFETY: i < n; each entry is a valid device until the list is freed.
        unsafe {
            let dev = *list.add(i);
            out.push(DeviceInfo {
                name: CStr::from_ptr(sys::ibv_get_device_name(dev))
                    .to_string_lossy()
                    .into_owned(),
                guid: u64::from_be(sys::ibv_get_device_guid(dev)),
            });
        }
    }
    // SAFETY: the list came from ibv_get_device_list and is freed once.
    unsafe { sys::ibv_free_device_list(list) };
    Ok(out)
}

pub(crate) struct ContextInner {
    ctx: NonNull<sys::ibv_context>,
    /// Contexts opened by RDMA CM belong to librdmacm, which keeps them open
    /// for the life of the process; only contexts we opened are closed.
    owned: bool,
}

// SAFETY: libibverbs contexts are thread-safe.
unsafe impl Send for ContextInner {}
unsafe impl Sync for ContextInner {}

impl Drop for ContextInner {
    fn drop(&mut self) {
        if self.owned {
            // SAFETY: every child object holds an Arc to this context, so
            // none is alive any more.
            let rc = unsafe { sys::ibv_close_device(self.ctx.as_ptr()) };
            if rc != 0 {
                log::warn!(
                    "ibv_close_device failed: {}",
                    std::io::Error::last_os_error()
                );
            }
        }
    }
}

/// An opened RDMA device. Cheap to clone; every object made from it keeps it
/// open.
#[derive(Clone)]
pub struct Context {
    pub(crate) inner: Arc<ContextInner>,
}

impl fmt::Debug for Context {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Context")
            .field("name", &self.name())
            .finish()
    }
}

impl Context {
    /// Opens the device called `name`; with `None`, the device named by
    /// `SNOWRDMA_DEVICE`, else the first device.
    pub fn open(name: Option<&str>) -> Result<Context> {
        let env_name = std::env::var(DEVICE_ENV).ok().filter(|s| !s.is_empty());
        let wanted = name.map(str::to_owned).or(env_name);
        let mut n = 0;
        // SAFETY: as in `devices`.
        let list = unsafe { sys::ibv_get_device_list(&mut n) };
        if list.is_null() || n == 0 {
            if !list.is_null() {
                // SAFETY: freed once.
                unsafe { sys::ibv_free_device_list(list) };
            }
            return Err(match wanted {
                Some(w) => Error::NoSuchDevice(w),
                None => Error::NoDevice,
            });
        }
        let mut chosen = None;
        for i in 0..n as usize {
            // SAFETY: i < n.
            let dev = unsafe { *list.add(i) };
            // SAFETY: dev is valid while the list is.
            let dev_name = unsafe { CStr::from_ptr(sys::ibv_get_device_name(dev)) };
            if wanted
                .as_deref()
                .is_none_or(|w| dev_name.to_bytes() == w.as_bytes())
            {
                chosen = Some(dev);
                break;
            }
        }
        let result = match chosen {
            None => Err(Error::NoSuchDevice(wanted.unwrap_or_default())),
            Some(dev) => {
                // SAFETY: dev is valid; the context outlives the list.
                let ctx = unsafe { sys::ibv_open_device(dev) };
                NonNull::new(ctx)
                    .map(|ctx| Context {
                        inner: Arc::new(ContextInner { ctx, owned: true }),
                    })
                    .ok_or_else(|| Error::last_os("ibv_open_device"))
            }
        };
        // SAFETY: freed once, after the last use of its entries.
        unsafe { sys::ibv_free_device_list(list) };
        result
    }

    /// The context librdmacm keeps for the device called `name` (with
    /// `None`, as in [`Context::open`]). Protection domains and CQs made on
    /// it can serve RDMA CM ids on that device as well as manual
    /// connections; those of [`Context::open`] cannot, because librdmacm
    /// opens each device itself.
    pub fn open_with_cm(name: Option<&str>) -> Result<Context> {
        let env_name = std::env::var(DEVICE_ENV).ok().filter(|s| !s.is_empty());
        let wanted = name.map(str::to_owned).or(env_name);
        let mut n = 0;
        // SAFETY: n is an out-parameter; the list is freed below.
        let list = unsafe { sys::rdma_get_devices(&mut n) };
        if list.is_null() {
            return Err(Error::last_os("rdma_get_devices"));
        }
        let mut chosen = None;
        for i in 0..n.max(0) as usize {
            // SAFETY: i < n; each entry is a live context librdmacm owns.
            let ctx = unsafe { *list.add(i) };
            // SAFETY: as above; the device outlives its context.
            let dev_name = unsafe { CStr::from_ptr(sys::ibv_get_device_name((*ctx).device)) };
            if wanted
                .as_deref()
                .is_none_or(|w| dev_name.to_bytes() == w.as_bytes())
            {
                chosen = NonNull::new(ctx);
                break;
            }
        }
        // SAFETY: freed once; the contexts stay open in librdmacm.
        unsafe { sys::rdma_free_devices(list) };
        match chosen {
            // SAFETY: a context librdmacm owns and keeps open.
            Some(ctx) => Ok(unsafe { Context::from_rdma_cm(ctx) }),
            None => Err(match wanted {
                Some(w) => Error::NoSuchDevice(w),
                None => Error::NoDevice,
            }),
        }
    }

    /// Wraps a context that librdmacm opened (an RDMA CM id's `verbs`).
    ///
    /// # Safety
    /// `ctx` must be a live context owned by librdmacm.
    pub(crate) unsafe fn from_rdma_cm(ctx: NonNull<sys::ibv_context>) -> Context {
        Context {
            inner: Arc::new(ContextInner { ctx, owned: false }),
        }
    }

    /// The raw `ibv_context`, for code that calls verbs this layer lacks.
    pub fn as_raw(&self) -> *mut sys::ibv_context {
        self.inner.ctx.as_ptr()
    }

    /// The device's kernel name.
    pub fn name(&self) -> String {
        // SAFETY: the context and its device are alive.
        unsafe {
            CStr::from_ptr(sys::ibv_get_device_name((*self.as_raw()).device))
                .to_string_lossy()
                .into_owned()
        }
    }

    /// What the device supports.
    pub fn query_device(&self) -> Result<DeviceAttr> {
        // SAFETY: zeroed is a valid ibv_device_attr; the verb fills it.
        let mut attr: sys::ibv_device_attr = unsafe { std::mem::zeroed() };
        // SAFETY: the context is alive, attr is writable.
        check_code("ibv_query_device", unsafe {
            sys::ibv_query_device(self.as_raw(), &mut attr)
        })?;
        // SAFETY: fw_ver is NUL-terminated by the verb.
        let fw = unsafe { CStr::from_ptr(attr.fw_ver.as_ptr()) };
        Ok(DeviceAttr {
            fw_ver: fw.to_string_lossy().into_owned(),
            node_guid: u64::from_be(attr.node_guid),
            vendor_id: attr.vendor_id,
            vendor_part_id: attr.vendor_part_id,
            phys_port_cnt: attr.phys_port_cnt,
            max_mr_size: attr.max_mr_size,
            max_qp: attr.max_qp,
            max_qp_wr: attr.max_qp_wr,
            max_sge: attr.max_sge,
            max_cq: attr.max_cq,
            max_cqe: attr.max_cqe,
            max_mr: attr.max_mr,
            max_pd: attr.max_pd,
            max_qp_rd_atom: attr.max_qp_rd_atom,
            max_qp_init_rd_atom: attr.max_qp_init_rd_atom,
            atomics: attr.atomic_cap != sys::ibv_atomic_cap::IBV_ATOMIC_NONE,
        })
    }

    /// The state of `port` (ports are numbered from 1).
    pub fn query_port(&self, port: u8) -> Result<PortAttr> {
        // SAFETY: zeroed is a valid ibv_port_attr; the verb fills it.
        let mut attr: sys::ibv_port_attr = unsafe { std::mem::zeroed() };
        // SAFETY: the context is alive, attr is writable and sized.
        check_code("ibv_query_port", unsafe {
            sys::___ibv_query_port(self.as_raw(), port, &mut attr)
        })?;
        Ok(PortAttr {
            port,
            state: PortState(attr.state),
            active_mtu: Mtu(attr.active_mtu),
            max_mtu: Mtu(attr.max_mtu),
            lid: attr.lid,
            gid_tbl_len: attr.gid_tbl_len,
            // IBV_LINK_LAYER_* are #defines that rdma-sys does not bind.
            link_layer: match attr.link_layer {
                1 => LinkLayer::Infiniband,
                2 => LinkLayer::Ethernet,
                _ => LinkLayer::Unspecified,
            },
        })
    }

    /// The GID at `index` of `port`.
    pub fn query_gid(&self, port: u8, index: u8) -> Result<Gid> {
        // SAFETY: zeroed is a valid ibv_gid.
        let mut gid: sys::ibv_gid = unsafe { std::mem::zeroed() };
        // SAFETY: the context is alive, gid is writable.
        check_code("ibv_query_gid", unsafe {
            sys::ibv_query_gid(self.as_raw(), port, i32::from(index), &mut gid)
        })?;
        // SAFETY: every bit pattern is a valid raw GID.
        Ok(Gid(unsafe { gid.raw }))
    }

    /// The non-empty entries of the GID table of `port`, with their type and
    /// network device where the kernel reports them.
    pub fn gid_table(&self, port: u8) -> Result<Vec<GidEntry>> {
        let len = self.query_port(port)?.gid_tbl_len.clamp(0, 256) as usize;
        let attrs = PathBuf::from(format!(
            "/sys/class/infiniband/{}/ports/{port}/gid_attrs",
            self.name()
        ));
        let mut out = Vec::new();
        for index in 0..len {
            let index = index as u8;
            let gid = match self.query_gid(port, index) {
                Ok(gid) => gid,
                // Unpopulated RoCE entries fail with EINVAL on some kernels.
                Err(_) => continue,
            };
            if gid.is_zero() {
                continue;
            }
            let read = |dir: &str| {
                std::fs::read_to_string(attrs.join(dir).join(index.to_string()))
                    .ok()
                    .map(|s| s.trim().to_string())
            };
            let kind = match read("types").as_deref() {
                Some("RoCE v2") => GidKind::RoceV2,
                Some("IB/RoCE v1") => GidKind::IbOrRoceV1,
                _ => GidKind::Unknown,
            };
            out.push(GidEntry {
                index,
                gid,
                kind,
                netdev: read("ndevs"),
            });
        }
        Ok(out)
    }

    /// The GID index to use for manually connected QPs on `port`: the value of
    /// `SNOWRDMA_GID_INDEX` when set, else the first RoCE v2 GID that maps an
    /// IPv4 address, else the first RoCE v2 GID, else 0 (InfiniBand).
    pub fn default_gid_index(&self, port: u8) -> Result<u8> {
        if let Ok(v) = std::env::var(GID_INDEX_ENV) {
            return v.trim().parse().map_err(|_| {
                Error::invalid(format!("{GID_INDEX_ENV}={v:?} is not a GID index (0-255)"))
            });
        }
        let table = self.gid_table(port)?;
        let pick = table
            .iter()
            .find(|e| e.kind == GidKind::RoceV2 && e.gid.to_ipv4().is_some())
            .or_else(|| table.iter().find(|e| e.kind == GidKind::RoceV2))
            .map_or(0, |e| e.index);
        Ok(pick)
    }

    /// The IPv4 address the port carries (from its IPv4-mapped RoCE GID),
    /// which is where RDMA CM peers reach it.
    pub fn ipv4_address(&self, port: u8) -> Result<Option<Ipv4Addr>> {
        let table = self.gid_table(port)?;
        let mut mapped = table
            .iter()
            .filter_map(|e| e.gid.to_ipv4().map(|ip| (e.kind, ip)));
        let all: Vec<_> = mapped.by_ref().collect();
        Ok(all
            .iter()
            .find(|(kind, _)| *kind == GidKind::RoceV2)
            .or(all.first())
            .map(|(_, ip)| *ip))
    }

    /// Allocates a protection domain.
    pub fn alloc_pd(&self) -> Result<ProtectionDomain> {
        ProtectionDomain::new(self)
    }

    /// Creates a completion channel, through which CQs report that they have
    /// completions.
    pub fn create_comp_channel(&self) -> Result<CompletionChannel> {
        CompletionChannel::new(self)
    }

    /// Creates a completion queue of at least `cqe` entries, reporting through
    /// `channel` when one is given.
    pub fn create_cq(
        &self,
        cqe: u32,
        channel: Option<&CompletionChannel>,
    ) -> Result<CompletionQueue> {
        CompletionQueue::new(self, cqe, channel)
    }
}

/// The device attributes most programs look at.
#[derive(Debug, Clone)]
pub struct DeviceAttr {
    pub fw_ver: String,
    pub node_guid: u64,
    pub vendor_id: u32,
    pub vendor_part_id: u32,
    pub phys_port_cnt: u8,
    pub max_mr_size: u64,
    pub max_qp: i32,
    pub max_qp_wr: i32,
    pub max_sge: i32,
    pub max_cq: i32,
    pub max_cqe: i32,
    pub max_mr: i32,
    pub max_pd: i32,
    /// Outstanding RDMA READs and atomics a QP can serve as target.
    pub max_qp_rd_atom: i32,
    /// Outstanding RDMA READs and atomics a QP can issue.
    pub max_qp_init_rd_atom: i32,
    /// Whether the device executes atomic CAS and FETCH-ADD.
    pub atomics: bool,
}

/// Port state as `ibv_port_attr.state`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PortState(pub u32);

impl PortState {
    pub const ACTIVE: PortState = PortState(sys::ibv_port_state::IBV_PORT_ACTIVE);
}

impl fmt::Display for PortState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // SAFETY: returns a static string for any value.
        let s = unsafe { CStr::from_ptr(sys::ibv_port_state_str(self.0)) };
        f.write_str(&s.to_string_lossy())
    }
}

/// A path MTU as the verbs encode it (1 = 256 B ... 5 = 4096 B).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct Mtu(pub u32);

impl Mtu {
    /// The MTU in bytes.
    pub fn bytes(self) -> u32 {
        match self.0 {
            1..=5 => 128 << self.0,
            _ => 0,
        }
    }
}

impl fmt::Display for Mtu {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.bytes())
    }
}

/// The link layer of a port.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LinkLayer {
    Infiniband,
    Ethernet,
    Unspecified,
}

/// What a port reports about itself.
#[derive(Debug, Clone)]
pub struct PortAttr {
    pub port: u8,
    pub state: PortState,
    pub active_mtu: Mtu,
    pub max_mtu: Mtu,
    pub lid: u16,
    pub gid_tbl_len: i32,
    pub link_layer: LinkLayer,
}

/// A 128-bit global identifier, in wire (network) byte order.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct Gid(pub [u8; 16]);

impl Gid {
    /// Whether every byte is zero (an empty table entry).
    pub fn is_zero(&self) -> bool {
        self.0 == [0; 16]
    }

    /// The IPv4 address of an IPv4-mapped GID (`::ffff:a.b.c.d`).
    pub fn to_ipv4(&self) -> Option<Ipv4Addr> {
        Ipv6Addr::from(self.0).to_ipv4_mapped()
    }
}

impl fmt::Display for Gid {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", Ipv6Addr::from(self.0))
    }
}

impl fmt::Debug for Gid {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Gid({self})")
    }
}

/// The RoCE version (or InfiniBand) a GID entry is for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GidKind {
    /// InfiniBand, or RoCE v1 on Ethernet.
    IbOrRoceV1,
    /// RoCE v2 (routable, over UDP).
    RoceV2,
    /// The kernel did not say.
    Unknown,
}

/// One populated entry of a port's GID table.
#[derive(Debug, Clone)]
pub struct GidEntry {
    pub index: u8,
    pub gid: Gid,
    pub kind: GidKind,
    /// The network interface the entry belongs to (RoCE).
    pub netdev: Option<String>,
}
