//! Which reactor a new session goes to.

use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use crate::session::PeerHello;

/// How busy one reactor is, as a placement function sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReactorLoad {
    /// The reactor's index.
    pub reactor: usize,
    /// Sessions placed on it and not yet gone (handshakes in flight too).
    pub sessions: usize,
    /// It takes new sessions (running, not stopped).
    pub open: bool,
}

/// A user's choice of reactor for a peer, from its hello and the reactors'
/// loads: `Some(index)` of an open reactor, or `None` to refuse the peer.
pub type ChooseFn = dyn Fn(&PeerHello, &[ReactorLoad]) -> Option<usize> + Send + Sync;

/// How a runtime spreads sessions over its reactors.
#[derive(Clone, Default)]
pub enum PlacementPolicy {
    /// Each new session on the next open reactor in turn.
    #[default]
    RoundRobin,
    /// Each new session on the open reactor with the fewest sessions
    /// (counting handshakes in flight), the lowest index on a tie.
    FewestSessions,
    /// A function of the peer's hello (its address, identity and QP names)
    /// and the loads. Sessions without a hello (clients the application
    /// connects itself) go to the fewest-sessions reactor.
    Custom(Arc<ChooseFn>),
}

impl fmt::Debug for PlacementPolicy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::RoundRobin => f.write_str("RoundRobin"),
            Self::FewestSessions => f.write_str("FewestSessions"),
            Self::Custom(_) => f.write_str("Custom(..)"),
        }
    }
}

/// A policy and its round-robin cursor.
#[derive(Debug, Default)]
pub(crate) struct Chooser {
    pub(crate) policy: PlacementPolicy,
    next: AtomicUsize,
}

impl Chooser {
    pub(crate) fn new(policy: PlacementPolicy) -> Self {
        Self {
            policy,
            next: AtomicUsize::new(0),
        }
    }

    /// The reactor for a session, or why there is none.
    pub(crate) fn choose(
        &self,
        hello: Option<&PeerHello>,
        loads: &[ReactorLoad],
    ) -> Result<usize, String> {
        if !loads.iter().any(|load| load.open) {
            return Err("no reactor is running".into());
        }
        match (&self.policy, hello) {
            (PlacementPolicy::RoundRobin, _) => {
                let n = loads.len();
                (0..n)
                    .map(|_| self.next.fetch_add(1, Ordering::Relaxed) % n)
                    .find(|&i| loads[i].open)
                    .ok_or_else(|| "no reactor is running".into())
            }
            (PlacementPolicy::Custom(choose), Some(hello)) => match choose(hello, loads) {
                Some(i) if loads.get(i).is_some_and(|load| load.open) => Ok(i),
                Some(i) if i < loads.len() => Err(format!(
                    "the placement function chose reactor {i}, which has stopped"
                )),
                Some(i) => Err(format!(
                    "the placement function chose reactor {i}, but there are {}",
                    loads.len()
                )),
                None => Err("the placement function refused the peer".into()),
            },
            _ => Ok(loads
                .iter()
                .filter(|load| load.open)
                .min_by_key(|load| (load.sessions, load.reactor))
                .map_or(0, |load| load.reactor)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn loads(sessions: &[usize]) -> Vec<ReactorLoad> {
        sessions
            .iter()
            .enumerate()
            .map(|(reactor, &sessions)| ReactorLoad {
                reactor,
                sessions,
                open: true,
            })
            .collect()
    }

    fn hello(identity: &str) -> PeerHello {
        PeerHello {
            peer: "127.0.0.1:9".parse().unwrap(),
            identity: identity.into(),
            qps: vec!["rpc".into()],
            authenticated: false,
        }
    }

    #[test]
    fn round_robin_takes_turns_and_skips_stopped_reactors() {
        let chooser = Chooser::new(PlacementPolicy::RoundRobin);
        let mut state = loads(&[0, 0, 0]);
        let picks: Vec<usize> = (0..4)
            .map(|_| chooser.choose(None, &state).unwrap())
            .collect();
        assert_eq!(picks, vec![0, 1, 2, 0]);
        state[2].open = false;
        let picks: Vec<usize> = (0..4)
            .map(|_| chooser.choose(None, &state).unwrap())
            .collect();
        assert_eq!(picks, vec![1, 0, 1, 0]);
        for load in &mut state {
            load.open = false;
        }
        assert_eq!(
            chooser.choose(None, &state).unwrap_err(),
            "no reactor is running"
        );
    }

    #[test]
    fn fewest_sessions_takes_the_least_loaded_open_reactor() {
        let chooser = Chooser::new(PlacementPolicy::FewestSessions);
        let mut state = loads(&[3, 1, 1]);
        assert_eq!(chooser.choose(None, &state), Ok(1));
        state[1].open = false;
        assert_eq!(chooser.choose(None, &state), Ok(2));
    }

    #[test]
    fn a_function_of_the_hello_decides_and_its_mistakes_are_named() {
        let by_identity: Arc<ChooseFn> = Arc::new(
            |hello: &PeerHello, _: &[ReactorLoad]| match hello.identity.as_str() {
                "bulk" => Some(1),
                "nobody" => None,
                "far" => Some(7),
                _ => Some(0),
            },
        );
        let chooser = Chooser::new(PlacementPolicy::Custom(by_identity));
        let mut state = loads(&[0, 5]);
        assert_eq!(chooser.choose(Some(&hello("bulk")), &state), Ok(1));
        assert_eq!(chooser.choose(Some(&hello("rpc")), &state), Ok(0));
        assert!(
            chooser
                .choose(Some(&hello("nobody")), &state)
                .unwrap_err()
                .contains("refused")
        );
        assert!(
            chooser
                .choose(Some(&hello("far")), &state)
                .unwrap_err()
                .contains("reactor 7, but there are 2")
        );
        // Without a hello: the fewest sessions.
        assert_eq!(chooser.choose(None, &state), Ok(0));
        state[1].open = false;
        assert!(
            chooser
                .choose(Some(&hello("bulk")), &state)
                .unwrap_err()
                .contains("has stopped")
        );
    }
}
