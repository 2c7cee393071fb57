//! Refusing a tool's arguments before it opens anything: one line on
//! stderr that names the argument and says what it accepts, and exit
//! status 2, as clap gives its own refusals. A tool checks every value
//! (addresses resolved, key read, core lists parsed, ranges) before it
//! opens a device, so a bad value is never reported as a missing NIC.

use std::fmt;
use std::net::{SocketAddr, ToSocketAddrs};
use std::process::ExitCode;
use std::str::FromStr;

/// The exit status of a refused argument (clap's for its own refusals).
pub const REFUSED: u8 = 2;

/// An argument a tool refuses, as the one line it prints.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Refusal {
    line: String,
}

impl Refusal {
    /// `argument value: accepts` (say `--size 0: must be 1 to 16777216`).
    pub fn new(argument: &str, value: impl fmt::Display, accepts: impl fmt::Display) -> Self {
        Self {
            line: format!("{argument} {value}: {accepts}"),
        }
    }

    /// `argument: why`, for an argument refused as a whole (missing, or
    /// clashing with another).
    pub fn of(argument: &str, why: impl fmt::Display) -> Self {
        Self {
            line: format!("{argument}: {why}"),
        }
    }

    /// Prints `tool: LINE` on stderr; the status to exit with.
    pub fn exit(&self, tool: &str) -> ExitCode {
        eprintln!("{tool}: {self}");
        ExitCode::from(REFUSED)
    }
}

impl fmt::Display for Refusal {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.line)
    }
}

/// Parses the command line. A value clap refuses (out of range, not a
/// number, not one of the choices) is said in one line, `tool: --flag
/// VALUE: what it accepts`, and the process exits with [`REFUSED`]; other
/// errors (an unknown flag, a missing one) are clap's own, with its usage
/// line, and the same status; `--help` and `--version` print and exit 0.
pub fn parse<P: clap::Parser>(tool: &str) -> P {
    parse_adjusted(tool, |command| command)
}

/// [`parse`], with the tool's own changes to the flags it shares (a
/// narrower range, say).
pub fn parse_adjusted<P: clap::Parser>(
    tool: &str,
    adjust: impl FnOnce(clap::Command) -> clap::Command,
) -> P {
    let parsed = adjust(P::command())
        .try_get_matches()
        .and_then(|matches| P::from_arg_matches(&matches));
    match parsed {
        Ok(parsed) => parsed,
        Err(err) => match one_line(&err) {
            Some(line) => {
                eprintln!("{tool}: {line}");
                std::process::exit(i32::from(REFUSED))
            }
            None => err.exit(),
        },
    }
}

/// A refused value in one line: the flag (without its value name), the
/// value and what the flag accepts.
fn one_line(err: &clap::Error) -> Option<String> {
    use clap::error::{ContextKind, ContextValue, ErrorKind};
    let text = |kind| match err.get(kind) {
        Some(ContextValue::String(text)) => Some(text.clone()),
        _ => None,
    };
    let flag = text(ContextKind::InvalidArg)?;
    let flag = flag
        .split_whitespace()
        .next()
        .unwrap_or_default()
        .to_string();
    let value = text(ContextKind::InvalidValue)?;
    let accepts = match err.kind() {
        ErrorKind::ValueValidation => std::error::Error::source(err)?.to_string(),
        ErrorKind::InvalidValue => match err.get(ContextKind::ValidValue) {
            Some(ContextValue::Strings(valid)) => format!("must be one of {}", valid.join(", ")),
            _ => return None,
        },
        _ => return None,
    };
    Some(Refusal::new(&flag, value, accepts).to_string())
}

/// A clap value parser for a number from `min` to `max`, both included,
/// whose refusal says so (`must be 1 to 64`).
pub fn range<T>(
    min: T,
    max: T,
) -> impl Fn(&str) -> Result<T, String> + Clone + Send + Sync + 'static
where
    T: FromStr + PartialOrd + fmt::Display + Copy + Send + Sync + 'static,
{
    move |text: &str| match text.trim().parse::<T>() {
        Ok(value) if min <= value && value <= max => Ok(value),
        _ => Err(format!("must be {min} to {max}")),
    }
}

/// A clap value parser for a number of at least `min` (`must be at least 1`).
pub fn at_least<T>(min: T) -> impl Fn(&str) -> Result<T, String> + Clone + Send + Sync + 'static
where
    T: FromStr + PartialOrd + fmt::Display + Copy + Send + Sync + 'static,
{
    move |text: &str| match text.trim().parse::<T>() {
        Ok(value) if min <= value => Ok(value),
        _ => Err(format!("must be at least {min}")),
    }
}

/// Checks that `text`, given as `argument`, is `HOST:PORT` (or
/// `[IPv6]:PORT`) and that the host resolves; its addresses.
pub fn address(argument: &str, text: &str) -> Result<Vec<SocketAddr>, Refusal> {
    let refuse = |why: String| Refusal::new(argument, text, format!("must be HOST:PORT ({why})"));
    let addrs: Vec<SocketAddr> = text
        .to_socket_addrs()
        .map_err(|err| refuse(err.to_string()))?
        .collect();
    if addrs.is_empty() {
        return Err(refuse("the host has no address".into()));
    }
    Ok(addrs)
}

/// Checks that `host`, given as `argument`, is a host name or address
/// that resolves; its first address, with `port`.
pub fn host(argument: &str, host: &str, port: u16) -> Result<SocketAddr, Refusal> {
    let refuse = |why: String| {
        Refusal::new(
            argument,
            host,
            format!("must be a host name or address ({why})"),
        )
    };
    (host, port)
        .to_socket_addrs()
        .map_err(|err| refuse(err.to_string()))?
        .next()
        .ok_or_else(|| refuse("it has no address".into()))
}

/// Checks a core list given as `argument` ("0,2,4-7"): it parses, names
/// no core twice, only cores this process may run on, and at least
/// `needed` of them. The cores, in order.
pub fn core_list(argument: &str, text: &str, needed: usize) -> Result<Vec<usize>, Refusal> {
    use rdma_comm_core::runtime::parse_core_list;
    let refuse = |why: String| Refusal::new(argument, text, why);
    let cores = parse_core_list(text).map_err(|err| refuse(reason(&err)))?;
    if cores.is_empty() {
        return Err(refuse("names no core".into()));
    }
    distinct_usable_cores(argument, text, &cores)?;
    if cores.len() < needed {
        return Err(refuse(format!(
            "names {} core(s), and {needed} are needed (one per reactor)",
            cores.len()
        )));
    }
    Ok(cores)
}

/// Checks `cores`, from the list `text` given as `argument`: none twice,
/// and each one this process may run on.
pub fn distinct_usable_cores(argument: &str, text: &str, cores: &[usize]) -> Result<(), Refusal> {
    use rdma_comm_core::runtime::{CoreChoice, CorePlan};
    let refuse = |why: String| Refusal::new(argument, text, why);
    if let Some(core) = cores
        .iter()
        .enumerate()
        .find_map(|(i, core)| cores[..i].contains(core).then_some(core))
    {
        return Err(refuse(format!(
            "core {core} is listed twice: each reactor needs a core of its own"
        )));
    }
    // The library's own check of a list, with no device involved: every
    // core is one this process may run on.
    CorePlan::choose("", cores.len(), &CoreChoice::List(cores.to_vec()))
        .map(drop)
        .map_err(|err| refuse(reason(&err)))
}

/// What an error of the library says, without the kind's prefix.
pub fn reason(err: &rdma_comm_core::Error) -> String {
    use rdma_comm_core::Error;
    match err {
        Error::InvalidArgument(why) => (*why).to_string(),
        Error::Runtime(why) => why.clone(),
        Error::Os { source, .. } => source.to_string(),
        other => other.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_range_accepts_its_ends_and_names_both_when_it_refuses() {
        let size = range(1usize, 64);
        assert_eq!(size("1"), Ok(1));
        assert_eq!(size("64"), Ok(64));
        assert_eq!(size("0"), Err("must be 1 to 64".to_string()));
        assert_eq!(size("65"), Err("must be 1 to 64".to_string()));
        assert_eq!(size("lots"), Err("must be 1 to 64".to_string()));
        let count = at_least(1u64);
        assert_eq!(count("1"), Ok(1));
        assert_eq!(count("0"), Err("must be at least 1".to_string()));
        assert_eq!(count("-1"), Err("must be at least 1".to_string()));
    }

    #[test]
    fn an_address_must_name_a_port_and_a_host_that_resolves() {
        assert_eq!(
            address("--connect", "127.0.0.1:7471").unwrap(),
            vec![SocketAddr::from(([127, 0, 0, 1], 7471))]
        );
        assert!(address("--listen", "[::1]:0").is_ok());
        let refused = address("--connect", "nohost").unwrap_err().to_string();
        assert!(
            refused.starts_with("--connect nohost: must be HOST:PORT"),
            "{refused}"
        );
        assert!(address("--connect", "127.0.0.1:notaport").is_err());
    }

    #[test]
    fn a_core_list_names_each_usable_core_once_and_enough_of_them() {
        let first = rdma_comm_core::reactor::usable_cores()
            .first()
            .copied()
            .unwrap_or(0);
        assert_eq!(core_list("--cores", &first.to_string(), 1), Ok(vec![first]));
        let twice = core_list("--cores", &format!("{first},{first}"), 1).unwrap_err();
        assert!(twice.to_string().contains("listed twice"), "{twice}");
        let short = core_list("--cores", &first.to_string(), 2).unwrap_err();
        assert!(short.to_string().contains("2 are needed"), "{short}");
        let junk = core_list("--cores", "0,x", 1).unwrap_err();
        assert!(junk.to_string().starts_with("--cores 0,x: "), "{junk}");
        let empty = core_list("--cores", ",", 1).unwrap_err();
        assert!(empty.to_string().contains("names no core"), "{empty}");
        let beyond = core_list("--cores", "100000", 1).unwrap_err();
        assert!(beyond.to_string().contains("may run on"), "{beyond}");
    }
}
