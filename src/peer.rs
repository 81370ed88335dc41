//! Who is asking: the process at the other end of a Unix-socket connection, as the kernel
//! says (SO_PEERCRED). Over TCP there is none. Its identity with its groups, taken once per
//! connection, is `access::connection`'s.

/// The peer of a Unix-socket connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Peer {
    /// Its process id (None where the kernel does not say: over TCP, or from another pid
    /// namespace).
    pub pid: Option<i32>,
    /// Its user id.
    pub uid: u32,
}

impl From<tokio::net::unix::UCred> for Peer {
    fn from(cred: tokio::net::unix::UCred) -> Peer {
        Peer {
            // 0: a process in another pid namespace (a container's), which the kernel does
            // not name to the daemon.
            pid: cred.pid().filter(|&p| p > 0),
            uid: cred.uid(),
        }
    }
}
