//! Counts the encoded gRPC messages the daemon holds until the socket takes them. tonic
//! encodes each batch into a buffer of its own (a copy of the batch's bytes) and hyper keeps
//! that buffer until the client's HTTP/2 window lets it all out: for a slow client, tens of
//! MB per stream that no other count sees. Each chunk of a response body is wrapped (no copy)
//! so that its bytes are counted until hyper drops it.

use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Arc;
use std::task::{Context, Poll};

/// Chunks smaller than this are not counted (headers, small batches: noise).
const COUNTED_FROM: usize = 64 << 10;

/// A response body whose large chunks count themselves in `bytes` while they live.
pub struct CountedBody<B> {
    inner: B,
    bytes: Arc<AtomicU64>,
}

impl<B> CountedBody<B> {
    pub fn new(inner: B, bytes: Arc<AtomicU64>) -> CountedBody<B> {
        CountedBody { inner, bytes }
    }
}

/// One chunk of a body, counted until dropped.
struct Chunk {
    data: Bytes,
    bytes: Arc<AtomicU64>,
}

impl AsRef<[u8]> for Chunk {
    fn as_ref(&self) -> &[u8] {
        &self.data
    }
}

impl Drop for Chunk {
    fn drop(&mut self) {
        self.bytes.fetch_sub(self.data.len() as u64, Relaxed);
    }
}

/// `data`, counted in `bytes` until the last handle on it is dropped.
fn counted(data: Bytes, bytes: &Arc<AtomicU64>) -> Bytes {
    if data.len() < COUNTED_FROM {
        return data;
    }
    bytes.fetch_add(data.len() as u64, Relaxed);
    Bytes::from_owner(Chunk {
        data,
        bytes: bytes.clone(),
    })
}

impl<B> Body for CountedBody<B>
where
    B: Body<Data = Bytes> + Unpin,
{
    type Data = Bytes;
    type Error = B::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, B::Error>>> {
        let this = self.get_mut();
        Pin::new(&mut this.inner)
            .poll_frame(cx)
            .map_ok(|frame| frame.map_data(|d| counted(d, &this.bytes)))
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_chunk_counts_until_its_last_slice_is_dropped() {
        let bytes = Arc::new(AtomicU64::new(0));
        let chunk = counted(Bytes::from(vec![1u8; 1 << 20]), &bytes);
        assert_eq!(bytes.load(Relaxed), 1 << 20);
        let (head, tail) = (chunk.slice(..100), chunk.slice(100..));
        drop(chunk);
        drop(head);
        assert_eq!(bytes.load(Relaxed), 1 << 20, "a slice still holds it");
        assert!(tail.iter().all(|&b| b == 1));
        drop(tail);
        assert_eq!(bytes.load(Relaxed), 0);
        let small = counted(Bytes::from_static(b"header"), &bytes);
        assert_eq!((bytes.load(Relaxed), &small[..]), (0, &b"header"[..]));
    }
}
