//! A Unix-socket connection with who is at its other end, taken once when it is accepted
//! (SO_PEERCRED and SO_PEERGROUPS): every request on it carries that identity. What one user's
//! connections may hold of the daemon: at most `limits.connections_per_user` at once
//! ([`PerUser`]), and a connection that asks nothing within `limits.idle_connection_seconds`
//! is closed.

use crate::sync::Locked;
use std::collections::HashMap;
use std::future::Future;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// The connections each user holds open, up to a limit.
pub struct PerUser {
    most: u32,
    held: Mutex<HashMap<u32, u32>>,
}

/// One connection of a user's, counted until dropped.
pub struct Held {
    per_user: Arc<PerUser>,
    uid: u32,
}

impl PerUser {
    pub fn new(most: u32) -> Arc<PerUser> {
        Arc::new(PerUser {
            most: most.max(1),
            held: Mutex::default(),
        })
    }

    /// Counts a connection of `uid`'s, unless they hold `most` already (None).
    pub fn admit(self: &Arc<Self>, uid: u32) -> Option<Held> {
        let mut held = self.held.locked();
        let n = held.entry(uid).or_default();
        if *n >= self.most {
            return None;
        }
        *n += 1;
        Some(Held {
            per_user: self.clone(),
            uid,
        })
    }

    /// Connections `uid` holds now.
    pub fn of(&self, uid: u32) -> u32 {
        let held = self.held.locked();
        held.get(&uid).copied().unwrap_or(0)
    }
}

impl Drop for Held {
    fn drop(&mut self) {
        let mut held = self.per_user.held.locked();
        if let Some(n) = held.get_mut(&self.uid) {
            *n -= 1;
            if *n == 0 {
                held.remove(&self.uid);
            }
        }
    }
}

/// A Unix-socket connection with who is at its other end, as the kernel said when it was
/// accepted: the gRPC handlers find the identity in each request (`access::Caller::of`).
pub struct PeerStream {
    /// The socket, its requests' `:authority` made one the HTTP/2 server takes.
    stream: super::local_authority::LocalAuthority<tokio::net::UnixStream>,
    identity: Arc<super::Identity>,
    /// Set by the first request on the connection (see `PeerInfo::asked`).
    asked: Arc<AtomicBool>,
    /// When a connection that has asked nothing is closed (None once it has asked).
    idle_until: Option<std::pin::Pin<Box<tokio::time::Sleep>>>,
    _held: Held,
}

impl PeerStream {
    /// `stream` with its peer's identity (SO_PEERCRED, SO_PEERGROUPS), counted in `held`,
    /// closed after `idle` unless it asks something before.
    pub fn new(
        stream: tokio::net::UnixStream,
        held: Held,
        idle: Duration,
    ) -> std::io::Result<PeerStream> {
        use std::os::fd::AsRawFd;
        let identity = super::Identity::of_socket(stream.as_raw_fd())?;
        Ok(PeerStream {
            stream: super::local_authority::LocalAuthority::new(stream),
            identity: Arc::new(identity),
            asked: Arc::default(),
            idle_until: Some(Box::pin(tokio::time::sleep(idle))),
            _held: held,
        })
    }
}

/// What a request on a [`PeerStream`] carries: the peer's identity, and the connection's
/// flag that it has asked something (set for each request: see `daemon`).
#[derive(Debug, Clone)]
pub struct PeerInfo(pub Arc<super::Identity>, pub Arc<AtomicBool>);

impl PeerInfo {
    /// Notes that the connection has asked something: it is no longer idle.
    pub fn asked(&self) {
        self.1.store(true, Ordering::Relaxed);
    }
}

impl tonic::transport::server::Connected for PeerStream {
    type ConnectInfo = PeerInfo;

    fn connect_info(&self) -> PeerInfo {
        PeerInfo(self.identity.clone(), self.asked.clone())
    }
}

impl tokio::io::AsyncRead for PeerStream {
    fn poll_read(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        if self.idle_until.is_some() {
            if self.asked.load(Ordering::Relaxed) {
                self.idle_until = None;
            } else if let Some(idle) = self.idle_until.as_mut() {
                if idle.as_mut().poll(cx).is_ready() {
                    return std::task::Poll::Ready(Err(std::io::Error::new(
                        std::io::ErrorKind::TimedOut,
                        "a connection that asked nothing",
                    )));
                }
            }
        }
        std::pin::Pin::new(&mut self.stream).poll_read(cx, buf)
    }
}

impl tokio::io::AsyncWrite for PeerStream {
    fn poll_write(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &[u8],
    ) -> std::task::Poll<std::io::Result<usize>> {
        std::pin::Pin::new(&mut self.stream).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> std::task::Poll<std::io::Result<usize>> {
        std::pin::Pin::new(&mut self.stream).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.stream.is_write_vectored()
    }

    fn poll_flush(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.stream).poll_flush(cx)
    }

    fn poll_shutdown(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.stream).poll_shutdown(cx)
    }
}
