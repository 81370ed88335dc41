//! A Unix-socket connection with who is at its other end, taken once when it is accepted
//! (SO_PEERCRED and SO_PEERGROUPS): every request on it carries that identity.

/// A Unix-socket connection with who is at its other end, as the kernel said when it was
/// accepted: the gRPC handlers find the identity in each request (`access::Caller::of`).
pub struct PeerStream {
    stream: tokio::net::UnixStream,
    identity: std::sync::Arc<super::Identity>,
}

impl PeerStream {
    /// `stream` with its peer's identity (SO_PEERCRED, SO_PEERGROUPS).
    pub fn new(stream: tokio::net::UnixStream) -> std::io::Result<PeerStream> {
        use std::os::fd::AsRawFd;
        let identity = super::Identity::of_socket(stream.as_raw_fd())?;
        Ok(PeerStream {
            stream,
            identity: std::sync::Arc::new(identity),
        })
    }
}

/// What a request on a [`PeerStream`] carries: the peer's identity.
#[derive(Debug, Clone)]
pub struct PeerInfo(pub std::sync::Arc<super::Identity>);

impl tonic::transport::server::Connected for PeerStream {
    type ConnectInfo = PeerInfo;

    fn connect_info(&self) -> PeerInfo {
        PeerInfo(self.identity.clone())
    }
}

impl tokio::io::AsyncRead for PeerStream {
    fn poll_read(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
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
