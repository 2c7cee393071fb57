//! Choosing the cores a runtime's reactors are pinned to: the cores of the
//! NIC's NUMA node first, then the rest of the machine, never two reactors
//! on one core; or exactly the cores the caller lists.

use std::fmt;

use crate::error::{Error, Result};
use crate::reactor::placement::cores_near;

/// Which cores a runtime's reactors run on.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum CoreChoice {
    /// One core each, those of the device's NUMA node first (from sysfs and
    /// hwloc), then the machine's other cores.
    #[default]
    NearDevice,
    /// Reactor `i` on the `i`th core of the list (OS CPU numbers).
    List(Vec<usize>),
    /// Leave the threads where the scheduler puts them.
    Unpinned,
}

/// Where a runtime's reactors go, and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CorePlan {
    /// The core of each reactor, by index (`None`: unpinned).
    pub cores: Vec<Option<usize>>,
    /// The device's NUMA node, when it could be read.
    pub numa_node: Option<u32>,
    /// Reactors whose core is on the device's NUMA node.
    pub near_device: usize,
    /// Why the device's node could not guide the choice (read once, said
    /// once in [`describe`](Self::describe)).
    pub note: Option<String>,
}

impl CorePlan {
    /// Chooses cores for `reactors` reactors serving `device`.
    ///
    /// # Errors
    /// [`Error::Runtime`] when fewer usable cores exist than reactors are
    /// asked for, when a listed core is listed twice or is not one this
    /// process may run on, or when no reactor is asked for.
    pub fn choose(device: &str, reactors: usize, choice: &CoreChoice) -> Result<Self> {
        // The process's cores, not this thread's: a pinned caller would
        // otherwise offer its one core to every reactor.
        let allowed = crate::reactor::placement::usable_cores();
        let near = match choice {
            CoreChoice::NearDevice => cores_near(device),
            _ => Err(String::new()),
        };
        plan(reactors, choice, near, allowed).map_err(Error::Runtime)
    }

    /// One line for people: which core each reactor got and why.
    pub fn describe(&self) -> String {
        self.to_string()
    }
}

impl fmt::Display for CorePlan {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let n = self.cores.len();
        let noun = if n == 1 { "reactor" } else { "reactors" };
        if self.cores.iter().all(Option::is_none) {
            return write!(f, "{n} {noun}, not pinned");
        }
        let list: Vec<String> = self
            .cores
            .iter()
            .map(|core| core.map_or("-".into(), |c| c.to_string()))
            .collect();
        write!(f, "{n} {noun} on cores {}", list.join(", "))?;
        match (&self.numa_node, &self.note) {
            (Some(node), _) => write!(
                f,
                " ({} of them on the device's NUMA node {node})",
                self.near_device
            ),
            (None, Some(note)) if !note.is_empty() => write!(f, " (any core: {note})"),
            _ => Ok(()),
        }
    }
}

/// The choice itself, from what the machine offers: `near` is the device's
/// node and its cores (or why they are unknown), `allowed` the cores this
/// process may run on.
pub(crate) fn plan(
    reactors: usize,
    choice: &CoreChoice,
    near: std::result::Result<(u32, Vec<usize>), String>,
    allowed: &[usize],
) -> std::result::Result<CorePlan, String> {
    if reactors == 0 {
        return Err("a runtime needs at least one reactor".into());
    }
    match choice {
        CoreChoice::Unpinned => Ok(CorePlan {
            cores: vec![None; reactors],
            numa_node: None,
            near_device: 0,
            note: None,
        }),
        CoreChoice::List(list) => {
            if list.len() < reactors {
                return Err(format!(
                    "{reactors} reactors need {reactors} cores, but the core list names {}",
                    list.len()
                ));
            }
            let list = &list[..reactors];
            for (i, core) in list.iter().enumerate() {
                if list[..i].contains(core) {
                    return Err(format!(
                        "core {core} is listed twice: each reactor needs a core of its own"
                    ));
                }
                if !allowed.is_empty() && !allowed.contains(core) {
                    return Err(format!(
                        "core {core} is not one this process may run on (it may use {})",
                        ranges(allowed)
                    ));
                }
            }
            Ok(CorePlan {
                cores: list.iter().copied().map(Some).collect(),
                numa_node: None,
                near_device: 0,
                note: None,
            })
        }
        CoreChoice::NearDevice => {
            let (numa_node, node_cores, note) = match near {
                Ok((node, cores)) => (Some(node), cores, None),
                Err(reason) => (None, Vec::new(), Some(reason)),
            };
            // The node's cores this process may use, then every other one.
            let mut order: Vec<usize> = node_cores
                .iter()
                .copied()
                .filter(|core| allowed.contains(core))
                .collect();
            let near_count = order.len();
            let rest: Vec<usize> = allowed
                .iter()
                .copied()
                .filter(|core| !order.contains(core))
                .collect();
            order.extend(rest);
            if order.len() < reactors {
                return Err(format!(
                    "{reactors} reactors need {reactors} cores of their own, but this process may run on only {} ({})",
                    order.len(),
                    if allowed.is_empty() {
                        "none could be read".to_string()
                    } else {
                        ranges(allowed)
                    }
                ));
            }
            order.truncate(reactors);
            Ok(CorePlan {
                near_device: near_count.min(reactors),
                cores: order.into_iter().map(Some).collect(),
                numa_node,
                note,
            })
        }
    }
}

/// "0-3, 8" for [0, 1, 2, 3, 8].
fn ranges(cores: &[usize]) -> String {
    let mut sorted = cores.to_vec();
    sorted.sort_unstable();
    let mut parts = Vec::new();
    let mut i = 0;
    while i < sorted.len() {
        let start = sorted[i];
        while i + 1 < sorted.len() && sorted[i + 1] == sorted[i] + 1 {
            i += 1;
        }
        parts.push(match sorted[i] {
            end if end == start => start.to_string(),
            end => format!("{start}-{end}"),
        });
        i += 1;
    }
    parts.join(", ")
}

/// Parses a core list as the tools take it: "0,2,4-7".
///
/// # Errors
/// [`Error::Runtime`] naming the part that is not a core number or range.
pub fn parse_core_list(text: &str) -> Result<Vec<usize>> {
    let mut cores = Vec::new();
    for part in text.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        let bad = || {
            Error::Runtime(format!(
                "{part:?} in the core list is not a core or a range like 2-5"
            ))
        };
        match part.split_once('-') {
            Some((from, to)) => {
                let (from, to): (usize, usize) = (
                    from.trim().parse().map_err(|_| bad())?,
                    to.trim().parse().map_err(|_| bad())?,
                );
                if from > to {
                    return Err(bad());
                }
                cores.extend(from..=to);
            }
            None => cores.push(part.parse().map_err(|_| bad())?),
        }
    }
    Ok(cores)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_devices_node_comes_first_then_the_rest_never_a_core_twice() {
        let plan = plan(
            3,
            &CoreChoice::NearDevice,
            Ok((1, vec![4, 5])),
            &[0, 1, 2, 3, 4, 5],
        )
        .unwrap();
        assert_eq!(plan.cores, vec![Some(4), Some(5), Some(0)]);
        assert_eq!(plan.numa_node, Some(1));
        assert_eq!(plan.near_device, 2);
        assert_eq!(
            plan.to_string(),
            "3 reactors on cores 4, 5, 0 (2 of them on the device's NUMA node 1)"
        );
    }

    #[test]
    fn node_cores_this_process_may_not_use_are_skipped() {
        let plan = plan(2, &CoreChoice::NearDevice, Ok((0, vec![0, 1])), &[1, 2, 3]).unwrap();
        assert_eq!(plan.cores, vec![Some(1), Some(2)]);
        assert_eq!(plan.near_device, 1);
    }

    #[test]
    fn without_a_numa_node_any_cores_and_the_reason_said_in_words() {
        let reason = "rxe0 reports no NUMA node (single-node machine or virtual device)";
        let plan = plan(2, &CoreChoice::NearDevice, Err(reason.into()), &[0, 1]).unwrap();
        assert_eq!(plan.cores, vec![Some(0), Some(1)]);
        assert_eq!(
            plan.to_string(),
            format!("2 reactors on cores 0, 1 (any core: {reason})")
        );
    }

    #[test]
    fn fewer_cores_than_reactors_is_a_clear_error() {
        let err = plan(3, &CoreChoice::NearDevice, Err("x".into()), &[0, 1]).unwrap_err();
        assert!(
            err.contains("3 reactors need 3 cores") && err.contains("only 2 (0-1)"),
            "{err}"
        );
        let err = plan(3, &CoreChoice::List(vec![0, 1]), Err("x".into()), &[0, 1]).unwrap_err();
        assert!(err.contains("the core list names 2"), "{err}");
        assert!(plan(0, &CoreChoice::Unpinned, Err("x".into()), &[0]).is_err());
    }

    #[test]
    fn a_core_list_is_taken_as_given_but_checked() {
        let plan = plan(
            2,
            &CoreChoice::List(vec![1, 0, 3]),
            Err("x".into()),
            &[0, 1, 2, 3],
        )
        .unwrap();
        assert_eq!(plan.cores, vec![Some(1), Some(0)]);
        let twice = super::plan(2, &CoreChoice::List(vec![1, 1]), Err("x".into()), &[0, 1]);
        assert!(twice.unwrap_err().contains("core 1 is listed twice"));
        let foreign = super::plan(
            1,
            &CoreChoice::List(vec![9]),
            Err("x".into()),
            &[0, 1, 2, 4],
        );
        assert!(
            foreign
                .unwrap_err()
                .contains("core 9 is not one this process may run on (it may use 0-2, 4)")
        );
    }

    #[test]
    fn unpinned_reactors_say_so() {
        let plan = plan(2, &CoreChoice::Unpinned, Err("x".into()), &[0]).unwrap();
        assert_eq!(plan.cores, vec![None, None]);
        assert_eq!(plan.to_string(), "2 reactors, not pinned");
    }

    #[test]
    fn core_lists_parse_like_taskset_ones() {
        assert_eq!(parse_core_list("0,2,4-6").unwrap(), vec![0, 2, 4, 5, 6]);
        assert_eq!(parse_core_list(" 3 ").unwrap(), vec![3]);
        assert!(parse_core_list("1,x").is_err());
        assert!(parse_core_list("5-2").is_err());
    }
}
