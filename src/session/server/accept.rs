//! The accept threads: TCP connections, or the connection manager's
//! connect requests, each admitted to the pending limits and handed to a
//! handshake thread of its own.

use super::*;
#[cfg(feature = "rdma_cm")]
use crate::session::cm;

/// Tells a refused connection why, without waiting for it to read.
fn refuse_at_once(mut stream: TcpStream, code: u16, reason: &str) {
    if stream.set_nonblocking(true).is_ok()
        && let Ok(frame) = Message::reject(code, reason).encode()
    {
        let _ = stream.write(&frame);
    }
}

pub(super) fn accept_loop(listener: TcpListener, wake: WakeReceiver, worker: Arc<Worker>) {
    let state = Arc::clone(&worker.state);
    let mut threads: Vec<JoinHandle<()>> = Vec::new();
    let mut accept_errors = 0u64;
    while !state.shutdown.load(Ordering::Acquire) {
        let (stream, peer) = match listener.accept() {
            Ok(conn) => conn,
            Err(err) if err.kind() == io::ErrorKind::WouldBlock => {
                if let Err(err) = wake.wait(&listener) {
                    log::error!("session listener {:?}: poll: {err}", listener.local_addr());
                    break;
                }
                continue;
            }
            Err(err) => {
                // EMFILE, ECONNABORTED and friends are per-connection; keep
                // going, logging the first and then every thousandth.
                if accept_errors.is_multiple_of(1000) {
                    log::warn!("session accept on {:?}: {err}", listener.local_addr());
                }
                accept_errors += 1;
                std::thread::sleep(Duration::from_millis(10));
                continue;
            }
        };
        threads.retain(|thread| !thread.is_finished());
        if stream.set_nonblocking(false).is_err() {
            continue;
        }
        if state.places.full() {
            // Every place is taken, some perhaps by handshakes that may
            // still fail or by peers about to leave: "busy" (come back)
            // rather than "no".
            refuse_at_once(stream, reject_code::BUSY, "the server is busy");
            continue;
        }
        let thread_worker = Arc::clone(&worker);
        match state.register(&worker.config, peer, Some(&stream)) {
            Ok(slot) => spawn_handshake(&mut threads, &state, peer, move || {
                run_handshake(&thread_worker, slot, peer, |admission| {
                    let config = &thread_worker.config;
                    let control =
                        Control::new(stream, peer, config.handshake_timeout, config.hello_timeout);
                    serve_handshake(&thread_worker, control, peer, admission, |control| {
                        Ok(ControlLink::tcp(control.into_stream()?))
                    })
                })
            }),
            Err(reason) => {
                refuse_at_once(stream, reject_code::BUSY, &reason);
                state.record_refusal(peer, reason);
            }
        }
    }
    // Stop listening first: a client whose handshake the cut ends finds
    // nobody on its one reconnect, and reports the cut.
    drop(listener);
    state.cut_pending();
    for thread in threads {
        let _ = thread.join();
    }
}

/// Starts a handshake's thread (`run`, which owns its pending slot).
fn spawn_handshake(
    threads: &mut Vec<JoinHandle<()>>,
    state: &State,
    peer: SocketAddr,
    run: impl FnOnce() + Send + 'static,
) {
    let spawned = std::thread::Builder::new()
        .name(format!("rdma-handshake-{peer}"))
        .spawn(run);
    match spawned {
        Ok(thread) => threads.push(thread),
        // The closure (and the slot in it) was dropped.
        Err(source) => state.record_failure(
            peer,
            Error::Os {
                what: "spawning a handshake thread",
                source,
            },
            true,
        ),
    }
}

#[cfg(feature = "rdma_cm")]
/// The connection manager's accept loop: the listener's event channel
/// brings connect requests; each one admitted to the pending limits gets
/// a handshake thread, which moves its id to a channel of its own.
pub(super) fn cm_accept_loop(
    channel: EventChannel,
    listener: CmId,
    wake: WakeReceiver,
    worker: Arc<Worker>,
) {
    let state = Arc::clone(&worker.state);
    let mut threads: Vec<JoinHandle<()>> = Vec::new();
    let mut errors = 0u64;
    while !state.shutdown.load(Ordering::Acquire) {
        let request = match channel.try_get_event() {
            // Anything but a request (the listener's own news) is
            // acknowledged; a removed device ends the listener.
            Ok(Some(mut event)) => match event.take_request() {
                Some(request) => request,
                None if event.kind() == CmEventKind::DeviceRemoval => {
                    log::error!(
                        "session listener {:?}: its device was removed; no more peers are accepted",
                        listener.local_addr()
                    );
                    break;
                }
                None => continue,
            },
            Ok(None) => {
                if let Err(err) = wake.wait(&channel) {
                    log::error!("session listener {:?}: poll: {err}", listener.local_addr());
                    break;
                }
                continue;
            }
            Err(err) => {
                if errors.is_multiple_of(1000) {
                    log::warn!("session listener {:?}: {err}", listener.local_addr());
                }
                errors += 1;
                std::thread::sleep(Duration::from_millis(10));
                continue;
            }
        };
        threads.retain(|thread| !thread.is_finished());
        let peer = request
            .peer_addr()
            .unwrap_or_else(|| SocketAddr::from(([0, 0, 0, 0], 0)));
        // Each refusal is recorded before the peer hears of it.
        if !cm::is_session_request(&request) {
            state.record_refusal(peer, "a connect request without the session tag".into());
            cm::refuse(request, reject_code::BAD_REQUEST);
            continue;
        }
        if state.places.full() {
            cm::refuse(request, reject_code::BUSY);
            continue;
        }
        match state.register(&worker.config, peer, None) {
            Ok(slot) => {
                let thread_worker = Arc::clone(&worker);
                spawn_handshake(&mut threads, &state, peer, move || {
                    run_handshake(&thread_worker, slot, peer, |admission| {
                        let config = &thread_worker.config;
                        let cut_state = Arc::clone(&thread_worker.state);
                        let control = cm::accept(
                            request,
                            peer,
                            config.handshake_timeout,
                            config.hello_timeout,
                            Box::new(move || cut_state.cut.load(Ordering::Acquire)),
                        )?;
                        serve_handshake(&thread_worker, control, peer, admission, |control| {
                            Ok(ControlLink::Cm(Box::new(control.into_link())))
                        })
                    })
                });
            }
            Err(reason) => {
                state.record_refusal(peer, reason);
                cm::refuse(request, reject_code::BUSY);
            }
        }
    }
    // Stop listening first: a client whose handshake the cut ends finds
    // nobody on its one reconnect, and reports the cut. (The channel lives
    // on while a connect request not yet taken up by its thread, whose id
    // is registered on it, does.)
    drop(listener);
    drop(channel);
    state.cut_pending();
    for thread in threads {
        let _ = thread.join();
    }
}
