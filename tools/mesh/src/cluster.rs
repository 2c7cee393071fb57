//! Rank, size and peer addresses from the launcher that started the job.
//!
//! Cluster tools are started by a launcher the site already runs, not by an
//! ssh loop of their own: Open MPI's `mpirun` exports
//! `OMPI_COMM_WORLD_RANK`/`OMPI_COMM_WORLD_SIZE`, Slurm's `srun` exports
//! `SLURM_PROCID`/`SLURM_NTASKS` plus the node list. [`World::discover`]
//! reads whichever is present (explicit values win) and maps every rank to
//! the host it runs on.
//!
//! ```ignore
//! assert_eq!(expand_nodelist("gpu[1-3,07],login").unwrap(), ["gpu1", "gpu2", "gpu3", "gpu07", "login"]);
//! let world = World::discover(
//!     Some(1),
//!     Some(2),
//!     Some(vec!["10.0.0.1".into(), "10.0.0.2".into()]),
//!     |_| None,
//! )
//! .unwrap();
//! assert_eq!(world.host(1), "10.0.0.2");
//! ```
//!
//! (A binary crate runs no doc tests: `tests::the_module_example_holds` runs
//! this one.)

use std::fmt;

/// Where the rank and size came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Launcher {
    /// `--rank`/`--size` given by hand.
    Explicit,
    /// Open MPI's `mpirun`/`mpiexec`.
    OpenMpi,
    /// Slurm's `srun`.
    Slurm,
}

impl fmt::Display for Launcher {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Launcher::Explicit => "explicit --rank/--size",
            Launcher::OpenMpi => "Open MPI",
            Launcher::Slurm => "Slurm",
        })
    }
}

/// This process's place in the job.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct World {
    /// This process's rank, `0..size`.
    pub rank: usize,
    /// Number of ranks.
    pub size: usize,
    /// Rank among the processes on this node (for picking a core).
    pub local_rank: usize,
    /// Host of every rank, by rank.
    pub hosts: Vec<String>,
    /// Who told us.
    pub launcher: Launcher,
}

/// Why the job's shape could not be worked out.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct WorldError(String);

impl World {
    /// Works out rank, size and hosts. `rank`/`size`/`hosts` are explicit
    /// values (command-line flags); `env` looks up an environment variable
    /// (pass `|k| std::env::var(k).ok()`).
    ///
    /// Hosts come from, in order: `hosts` (one per rank, or one per node
    /// with the ranks spread evenly in blocks); Slurm's node list with its
    /// tasks per node; or, when Open MPI says every rank is on this node,
    /// loopback for all.
    pub fn discover(
        rank: Option<usize>,
        size: Option<usize>,
        hosts: Option<Vec<String>>,
        env: impl Fn(&str) -> Option<String>,
    ) -> Result<World, WorldError> {
        let number = |key: &str| -> Result<Option<usize>, WorldError> {
            env(key)
                .map(|v| {
                    v.trim().parse::<usize>().map_err(|_| {
                        WorldError(format!("{key}={v:?} is not a non-negative number"))
                    })
                })
                .transpose()
        };
        let (rank, size, launcher) = match (rank, size) {
            (Some(rank), Some(size)) => (rank, size, Launcher::Explicit),
            (Some(_), None) | (None, Some(_)) => {
                return Err(WorldError("--rank and --size go together".into()));
            }
            (None, None) => {
                if let (Some(rank), Some(size)) = (
                    number("OMPI_COMM_WORLD_RANK")?,
                    number("OMPI_COMM_WORLD_SIZE")?,
                ) {
                    (rank, size, Launcher::OpenMpi)
                } else if let (Some(rank), Some(size)) =
                    (number("SLURM_PROCID")?, number("SLURM_NTASKS")?)
                {
                    (rank, size, Launcher::Slurm)
                } else {
                    return Err(WorldError(
                        "no rank: start under mpirun or srun, or give --rank and --size".into(),
                    ));
                }
            }
        };
        if size == 0 || rank >= size {
            return Err(WorldError(format!(
                "rank {rank} is not within a size of {size}"
            )));
        }
        let local_rank = number("OMPI_COMM_WORLD_LOCAL_RANK")?
            .or(number("SLURM_LOCALID")?)
            .unwrap_or(0);
        let hosts = match hosts {
            Some(hosts) => spread(hosts, size)?,
            None if launcher == Launcher::Slurm => {
                let nodes = env("SLURM_JOB_NODELIST")
                    .or_else(|| env("SLURM_NODELIST"))
                    .ok_or_else(|| WorldError("Slurm set no SLURM_JOB_NODELIST".into()))?;
                let nodes = expand_nodelist(&nodes)?;
                let tasks = match env("SLURM_TASKS_PER_NODE") {
                    Some(tasks) => expand_tasks_per_node(&tasks)?,
                    None => vec![size.div_ceil(nodes.len()); nodes.len()],
                };
                block_hosts(&nodes, &tasks, size)?
            }
            None if launcher == Launcher::OpenMpi
                && number("OMPI_COMM_WORLD_LOCAL_SIZE")? == Some(size) =>
            {
                vec!["127.0.0.1".to_string(); size]
            }
            None => {
                return Err(WorldError(format!(
                    "the {size} ranks' hosts are unknown: give --hosts or --hostfile"
                )));
            }
        };
        Ok(World {
            rank,
            size,
            local_rank,
            hosts,
            launcher,
        })
    }

    /// The host rank `rank` runs on.
    pub fn host(&self, rank: usize) -> &str {
        &self.hosts[rank]
    }
}

/// One host per rank as given, or one per node with ranks in equal blocks.
fn spread(hosts: Vec<String>, size: usize) -> Result<Vec<String>, WorldError> {
    if hosts.is_empty() || !size.is_multiple_of(hosts.len()) {
        return Err(WorldError(format!(
            "{} hosts for {size} ranks: give one per rank, or a number of hosts that divides the ranks",
            hosts.len()
        )));
    }
    let per_host = size / hosts.len();
    Ok(hosts
        .into_iter()
        .flat_map(|host| std::iter::repeat_n(host, per_host))
        .collect())
}

/// Slurm's default block distribution: the first node's tasks, then the next's.
fn block_hosts(nodes: &[String], tasks: &[usize], size: usize) -> Result<Vec<String>, WorldError> {
    let hosts: Vec<String> = nodes
        .iter()
        .zip(tasks)
        .flat_map(|(node, &count)| std::iter::repeat_n(node.clone(), count))
        .collect();
    if hosts.len() < size {
        return Err(WorldError(format!(
            "Slurm's node list places {} tasks, but there are {size}",
            hosts.len()
        )));
    }
    Ok(hosts.into_iter().take(size).collect())
}

/// Expands a Slurm host list such as `node[01-03,7],gpu5` (zero padding kept).
pub fn expand_nodelist(list: &str) -> Result<Vec<String>, WorldError> {
    let bad = || WorldError(format!("cannot parse the node list {list:?}"));
    let mut hosts = Vec::new();
    let mut rest = list.trim();
    while !rest.is_empty() {
        // One entry runs to the next comma outside brackets.
        let mut depth = 0i32;
        let end = rest
            .char_indices()
            .find(|&(_, c)| {
                match c {
                    '[' => depth += 1,
                    ']' => depth -= 1,
                    _ => {}
                }
                c == ',' && depth == 0
            })
            .map_or(rest.len(), |(i, _)| i);
        let entry = &rest[..end];
        rest = rest[end..].trim_start_matches(',');
        match entry.find('[') {
            None if !entry.is_empty() => hosts.push(entry.to_string()),
            None => return Err(bad()),
            Some(open) => {
                let close = entry.find(']').ok_or_else(bad)?;
                let (prefix, suffix) = (&entry[..open], &entry[close + 1..]);
                for range in entry[open + 1..close].split(',') {
                    let (first, last) = range.split_once('-').unwrap_or((range, range));
                    let width = first.len();
                    let first: u64 = first.parse().map_err(|_| bad())?;
                    let last: u64 = last.parse().map_err(|_| bad())?;
                    if last < first || last - first > 100_000 {
                        return Err(bad());
                    }
                    hosts.extend((first..=last).map(|n| format!("{prefix}{n:0width$}{suffix}")));
                }
            }
        }
    }
    if hosts.is_empty() {
        return Err(bad());
    }
    Ok(hosts)
}

/// Expands `SLURM_TASKS_PER_NODE` such as `2(x3),1` into one count per node.
pub fn expand_tasks_per_node(spec: &str) -> Result<Vec<usize>, WorldError> {
    let bad = || WorldError(format!("cannot parse SLURM_TASKS_PER_NODE={spec:?}"));
    let mut counts = Vec::new();
    for part in spec.trim().split(',') {
        let (count, repeat) = match part.split_once("(x") {
            Some((count, repeat)) => (count, repeat.strip_suffix(')').ok_or_else(bad)?),
            None => (part, "1"),
        };
        let count: usize = count.parse().map_err(|_| bad())?;
        let repeat: usize = repeat.parse().map_err(|_| bad())?;
        counts.extend(std::iter::repeat_n(count, repeat));
    }
    Ok(counts)
}

/// Reads an Open MPI style hostfile: one host per line, optionally
/// `slots=N` (that many ranks on it, in order); `#` starts a comment.
pub fn parse_hostfile(text: &str) -> Result<Vec<String>, WorldError> {
    let mut hosts = Vec::new();
    for (number, line) in text.lines().enumerate() {
        let line = line.split('#').next().unwrap_or("").trim();
        let mut words = line.split_whitespace();
        let Some(host) = words.next() else { continue };
        let mut slots = 1;
        for word in words {
            match word.strip_prefix("slots=") {
                Some(n) => {
                    slots = n.parse().map_err(|_| {
                        WorldError(format!("hostfile line {}: bad slots {n:?}", number + 1))
                    })?
                }
                None if word.starts_with("max_slots=") => {}
                None => {
                    return Err(WorldError(format!(
                        "hostfile line {}: unknown field {word:?}",
                        number + 1
                    )));
                }
            }
        }
        hosts.extend(std::iter::repeat_n(host.to_string(), slots));
    }
    Ok(hosts)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn env(vars: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
        let map: HashMap<String, String> = vars
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        move |key| map.get(key).cloned()
    }

    #[test]
    fn the_module_example_holds() {
        assert_eq!(
            expand_nodelist("gpu[1-3,07],login").unwrap(),
            ["gpu1", "gpu2", "gpu3", "gpu07", "login"]
        );
        let world = World::discover(
            Some(1),
            Some(2),
            Some(vec!["10.0.0.1".into(), "10.0.0.2".into()]),
            |_| None,
        )
        .unwrap();
        assert_eq!(world.host(1), "10.0.0.2");
    }

    #[test]
    fn open_mpi_on_one_node_uses_loopback() {
        let world = World::discover(
            None,
            None,
            None,
            env(&[
                ("OMPI_COMM_WORLD_RANK", "2"),
                ("OMPI_COMM_WORLD_SIZE", "4"),
                ("OMPI_COMM_WORLD_LOCAL_RANK", "2"),
                ("OMPI_COMM_WORLD_LOCAL_SIZE", "4"),
            ]),
        )
        .unwrap();
        assert_eq!((world.rank, world.size, world.local_rank), (2, 4, 2));
        assert_eq!(world.launcher, Launcher::OpenMpi);
        assert_eq!(world.hosts, vec!["127.0.0.1"; 4]);
    }

    #[test]
    fn open_mpi_across_nodes_needs_hosts() {
        let vars = [
            ("OMPI_COMM_WORLD_RANK", "0"),
            ("OMPI_COMM_WORLD_SIZE", "4"),
            ("OMPI_COMM_WORLD_LOCAL_SIZE", "2"),
        ];
        let err = World::discover(None, None, None, env(&vars)).unwrap_err();
        assert!(err.to_string().contains("--hosts"), "{err}");
        let world =
            World::discover(None, None, Some(vec!["a".into(), "b".into()]), env(&vars)).unwrap();
        assert_eq!(world.hosts, ["a", "a", "b", "b"]);
    }

    #[test]
    fn slurm_places_ranks_in_blocks_over_its_node_list() {
        let world = World::discover(
            None,
            None,
            None,
            env(&[
                ("SLURM_PROCID", "3"),
                ("SLURM_NTASKS", "5"),
                ("SLURM_LOCALID", "0"),
                ("SLURM_JOB_NODELIST", "n[08-10]"),
                ("SLURM_TASKS_PER_NODE", "2(x2),1"),
            ]),
        )
        .unwrap();
        assert_eq!(world.launcher, Launcher::Slurm);
        assert_eq!(world.hosts, ["n08", "n08", "n09", "n09", "n10"]);
        assert_eq!(world.host(world.rank), "n09");
    }

    #[test]
    fn explicit_values_win_and_are_checked() {
        let vars = [("OMPI_COMM_WORLD_RANK", "0"), ("OMPI_COMM_WORLD_SIZE", "2")];
        let world = World::discover(Some(1), Some(3), Some(vec!["h".into()]), env(&vars)).unwrap();
        assert_eq!(
            (world.rank, world.size, world.launcher),
            (1, 3, Launcher::Explicit)
        );
        assert!(World::discover(Some(3), Some(3), None, env(&[])).is_err());
        assert!(World::discover(Some(0), None, None, env(&[])).is_err());
        assert!(World::discover(None, None, None, env(&[])).is_err());
        let garbage = [("SLURM_PROCID", "x"), ("SLURM_NTASKS", "2")];
        assert!(World::discover(None, None, None, env(&garbage)).is_err());
    }

    #[test]
    fn node_lists_expand_like_slurm() {
        assert_eq!(expand_nodelist("a").unwrap(), ["a"]);
        assert_eq!(
            expand_nodelist("rack1-n[1-2,10],b[3]x").unwrap(),
            ["rack1-n1", "rack1-n2", "rack1-n10", "b3x"]
        );
        assert_eq!(
            expand_nodelist("c[009-011]").unwrap(),
            ["c009", "c010", "c011"]
        );
        for bad in ["", "a[", "a[3-1]", "a[x]", ","] {
            assert!(expand_nodelist(bad).is_err(), "{bad:?}");
        }
        assert_eq!(expand_tasks_per_node("2(x3),1").unwrap(), [2, 2, 2, 1]);
        assert!(expand_tasks_per_node("2(x3").is_err());
    }

    #[test]
    fn hostfiles_follow_open_mpi_slots() {
        let hosts =
            parse_hostfile("# cluster\nnode1 slots=2\n\nnode2 max_slots=4  # one\n").unwrap();
        assert_eq!(hosts, ["node1", "node1", "node2"]);
        assert!(parse_hostfile("node1 cpus=2").is_err());
    }
}
