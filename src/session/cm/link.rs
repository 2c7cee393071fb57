//! An established session's link over the connection manager: the
//! control QP after the handshake, which carries only the goodbye, the
//! disconnect that follows it, and the thread that sees a dropped link's
//! goodbye off.

use std::os::fd::{AsFd, BorrowedFd};
use std::sync::OnceLock;
use std::sync::mpsc::{self, Receiver, Sender};
use std::time::Instant;

use super::{ControlQp, GOODBYE_WAIT, POLL_PAUSE};
use crate::error::Error;
use crate::session::endpoint::PeerStatus;
use crate::session::wire::Message;

impl ControlQp {
    /// The established session's link.
    pub(in crate::session) fn into_link(mut self) -> CmLink {
        self.cut = None;
        CmLink {
            control: Some(self),
            goodbye_pending: false,
            disconnect_due: false,
        }
    }
}

/// An established session's control QP and event channel.
pub(in crate::session) struct CmLink {
    /// Present until the link is dropped (then perhaps handed to the
    /// goodbye thread).
    control: Option<ControlQp>,
    /// Our goodbye is posted and not acknowledged yet.
    goodbye_pending: bool,
    /// The disconnect waits for the goodbye's acknowledgement, so that the
    /// peer reads the goodbye before it hears of the disconnect.
    disconnect_due: bool,
}

impl CmLink {
    fn control(&mut self) -> &mut ControlQp {
        self.control
            .as_mut()
            .expect("a link's control QP is there until the link is dropped")
    }

    /// Looks for the peer's goodbye or the end of the connection, without
    /// blocking.
    pub(in crate::session) fn check(&mut self) -> PeerStatus {
        let polled = self.control().poll();
        if let Err(err) = polled {
            return PeerStatus::Lost(err);
        }
        self.goodbye_acknowledged();
        if let Some(status) = self.goodbye() {
            return status;
        }
        let ended = self.control().check_events();
        match ended {
            Ok(()) => PeerStatus::Alive,
            Err(err) => {
                // The peer's goodbye was acknowledged before its disconnect
                // went out: if one came, it is in the CQ by now.
                if self.control().poll().is_ok()
                    && let Some(status) = self.goodbye()
                {
                    return status;
                }
                PeerStatus::Lost(err)
            }
        }
    }

    /// Sends the delayed disconnect once our goodbye is acknowledged.
    fn goodbye_acknowledged(&mut self) {
        if self.goodbye_pending && !self.control().sending {
            self.goodbye_pending = false;
            if self.disconnect_due {
                self.disconnect();
            }
        }
    }

    /// The peer's goodbye, or anything else it had no business sending.
    fn goodbye(&mut self) -> Option<PeerStatus> {
        let control = self.control();
        let peer = control.peer;
        let bytes = match control.take_arrived() {
            Ok(bytes) => bytes?,
            Err(source) => return Some(PeerStatus::Lost(Error::PeerGone { peer, source })),
        };
        Some(match Message::decode(&bytes) {
            Ok((Message::Disconnect { code }, used)) if used == bytes.len() => {
                PeerStatus::Disconnected { code }
            }
            Ok((other, _)) => PeerStatus::Lost(Error::Protocol {
                peer,
                what: format!("unexpected control message {other:?} on an established endpoint"),
            }),
            Err(source) => PeerStatus::Lost(Error::PeerGone { peer, source }),
        })
    }

    /// Posts the goodbye without waiting: whether it was posted (not when
    /// the connection is known to be over). Its acknowledgement, and the
    /// disconnect after it, are awaited by [`check`](Self::check) or, once
    /// the link is dropped, by a background thread for at most
    /// [`GOODBYE_WAIT`].
    pub(in crate::session) fn send_disconnect(&mut self, code: u16) -> bool {
        let control = self.control();
        if control.ended.is_some() {
            return false;
        }
        let Ok(frame) = (Message::Disconnect { code }).encode() else {
            return false;
        };
        if control.post(&frame).is_err() {
            return false;
        }
        self.goodbye_pending = true;
        let _ = self.control().poll();
        self.goodbye_acknowledged();
        true
    }

    /// Disconnects, after the goodbye if one is on its way: the peer's side
    /// reports `Disconnected`.
    pub(in crate::session) fn disconnect(&mut self) {
        if self.goodbye_pending {
            self.disconnect_due = true;
            return;
        }
        self.disconnect_due = false;
        if let Some(id) = self.control().id.as_mut() {
            let _ = id.disconnect();
        }
    }
}

impl Drop for CmLink {
    fn drop(&mut self) {
        let Some(control) = self.control.take() else {
            return;
        };
        // A goodbye still on its way is given its time elsewhere; without
        // one, destroying the id disconnects at once.
        if self.goodbye_pending && control.ended.is_none() {
            let farewell = Farewell {
                control,
                until: Instant::now() + GOODBYE_WAIT,
            };
            // Without the thread, the link goes now (the goodbye may be lost).
            if let Some(queue) = farewells() {
                let _ = queue.send(farewell);
            }
        }
    }
}

/// The session's event channel: readable when the connection manager has
/// news (the peer's disconnect, above all).
impl AsFd for CmLink {
    fn as_fd(&self) -> BorrowedFd<'_> {
        let control = self
            .control
            .as_ref()
            .expect("a link's control QP is there until the link is dropped");
        control.channel.as_fd()
    }
}

/// A dropped link whose goodbye is still on its way.
struct Farewell {
    control: ControlQp,
    until: Instant,
}

impl Farewell {
    /// Whether it is done: the goodbye acknowledged (then disconnected),
    /// failed, or out of time.
    fn done(&mut self) -> bool {
        let acknowledged = matches!(self.control.poll(), Ok(true)) || !self.control.sending;
        let over = self.control.check_events().is_err() || Instant::now() >= self.until;
        if acknowledged && let Some(id) = self.control.id.as_mut() {
            let _ = id.disconnect();
        }
        acknowledged || over
    }
}

/// The goodbye thread's queue, started with the first farewell; `None` if
/// the thread could not be started (then links go at once).
fn farewells() -> Option<&'static Sender<Farewell>> {
    static QUEUE: OnceLock<Option<Sender<Farewell>>> = OnceLock::new();
    QUEUE
        .get_or_init(|| {
            let (tx, rx) = mpsc::channel();
            std::thread::Builder::new()
                .name("rdma-cm-goodbye".into())
                .spawn(move || see_off(rx))
                .ok()
                .map(|_| tx)
        })
        .as_ref()
}

/// The goodbye thread: each link goes once its goodbye is acknowledged or
/// its time is up; asleep in `recv` while there are none.
fn see_off(queue: Receiver<Farewell>) {
    let mut waiting: Vec<Farewell> = Vec::new();
    loop {
        if waiting.is_empty() {
            match queue.recv() {
                Ok(farewell) => waiting.push(farewell),
                Err(_) => return,
            }
        }
        waiting.extend(queue.try_iter());
        waiting.retain_mut(|farewell| !farewell.done());
        if !waiting.is_empty() {
            std::thread::sleep(POLL_PAUSE);
        }
    }
}
