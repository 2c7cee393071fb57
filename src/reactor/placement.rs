//! Pinning a reactor thread to a core, preferably on the NIC's NUMA node.

use std::sync::{Once, OnceLock};

/// Where a reactor thread should run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum CorePreference {
    /// Leave the thread where the scheduler puts it.
    Unpinned,
    /// Pin to this OS CPU number.
    Core(usize),
    /// Pin to the `n`th core of the NUMA node nearest the device (wrapping),
    /// falling back to the `n`th core of the machine.
    #[default]
    NearDevice,
}

/// Where a thread ended up, and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Placement {
    /// The CPU the thread is pinned to, if any.
    pub core: Option<usize>,
    /// The device's NUMA node, when it could be read.
    pub numa_node: Option<u32>,
    /// Why the preferred placement was not possible.
    pub fallback: Option<String>,
}

static FALLBACK_NOTICE: Once = Once::new();

/// Pins the calling thread according to `preference` for `device`; `nth`
/// spreads several reactors over the node's cores.
pub fn pin_current_thread(device: &str, preference: CorePreference, nth: usize) -> Placement {
    let (core, numa_node, fallback) = match preference {
        CorePreference::Unpinned => (None, None, None),
        CorePreference::Core(core) => (Some(core), None, None),
        CorePreference::NearDevice => match cores_near(device) {
            Ok((node, cores)) if !cores.is_empty() => {
                (Some(cores[nth % cores.len()]), Some(node), None)
            }
            Ok((node, _)) => (
                any_core(nth),
                Some(node),
                Some(format!("NUMA node {node} of {device} lists no cores")),
            ),
            Err(reason) => (any_core(nth), None, Some(reason)),
        },
    };
    if let Some(reason) = &fallback {
        FALLBACK_NOTICE.call_once(|| {
            log::warn!("reactor placement: {reason}; pinning to any core instead (said once)");
        });
    }
    let pinned = core.filter(|&id| core_affinity::set_for_current(core_affinity::CoreId { id }));
    Placement {
        core: pinned,
        numa_node,
        fallback,
    }
}

fn any_core(nth: usize) -> Option<usize> {
    let cores = usable_cores();
    (!cores.is_empty()).then(|| cores[nth % cores.len()])
}

/// The cores this process may run on, as the first thread that asked saw
/// them (its affinity: a `taskset` or cgroup limit is respected), sorted.
///
/// Not each caller's own affinity: a thread spawned by a pinned thread
/// inherits that one core, and choosing "the nth core" among its own would
/// put every reactor it starts on the same core. So the first look is
/// kept; ask before pinning anything (placement and
/// [`CorePlan`](crate::runtime::CorePlan) ask on first use). Empty when
/// the affinity cannot be read.
pub fn usable_cores() -> &'static [usize] {
    static CORES: OnceLock<Vec<usize>> = OnceLock::new();
    CORES.get_or_init(|| {
        let mut cores: Vec<usize> = core_affinity::get_core_ids()
            .unwrap_or_default()
            .into_iter()
            .map(|core| core.id)
            .collect();
        cores.sort_unstable();
        cores
    })
}

/// The device's NUMA node (from sysfs) and that node's CPUs (from hwloc).
pub(crate) fn cores_near(device: &str) -> Result<(u32, Vec<usize>), String> {
    let path = format!("/sys/class/infiniband/{device}/device/numa_node");
    let raw = std::fs::read_to_string(&path).map_err(|e| match e.kind() {
        std::io::ErrorKind::NotFound => {
            format!("{device} has no NUMA node in sysfs (a virtual device, such as Soft-RoCE)")
        }
        _ => format!("cannot read {path} ({e})"),
    })?;
    let node: i64 = raw
        .trim()
        .parse()
        .map_err(|_| format!("{path} holds {raw:?}"))?;
    if node < 0 {
        return Err(format!(
            "{device} reports no NUMA node (single-node machine or virtual device)"
        ));
    }
    let node = node as u32;
    let topology = hwloc2::Topology::new().ok_or("hwloc could not load the topology")?;
    let nodes = topology
        .objects_with_type(&hwloc2::ObjectType::NUMANode)
        .map_err(|e| format!("hwloc lists no NUMA nodes ({e:?})"))?;
    let cpuset = nodes
        .iter()
        .find(|obj| obj.os_index() == node)
        .and_then(|obj| obj.cpuset())
        .ok_or_else(|| format!("hwloc has no CPU set for NUMA node {node}"))?;
    Ok((node, cpuset.into_iter().map(|cpu| cpu as usize).collect()))
}
