//! Counts the encoded gRPC messages the daemon holds until the socket takes them. tonic
//! encodes each batch into a buffer of its own (a copy of the batch's bytes); hyper keeps the
//! encoded message until the client's HTTP/2 window lets it all out, and the response body
//! keeps that buffer's allocation for its next message: for a slow client, tens of MB per
//! stream that no other count sees. Each response body counts the largest message it has
//! passed (its encode buffer's size) until the body is dropped.

use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Arc;
use std::task::{Context, Poll};

/// Chunks smaller than this are not counted (headers, small batches: noise).
const COUNTED_FROM: u64 = 64 << 10;

/// A response body that counts its largest chunk in `bytes` while it lives.
pub struct CountedBody<B> {
    inner: B,
    bytes: Arc<AtomicU64>,
    /// What this body counts in `bytes` now.
    largest: u64,
}

impl<B> CountedBody<B> {
    pub fn new(inner: B, bytes: Arc<AtomicU64>) -> CountedBody<B> {
        CountedBody {
            inner,
            bytes,
            largest: 0,
        }
    }

    /// A chunk of `len` bytes passed: the body's encode buffer is at least that large.
    fn saw(&mut self, len: u64) {
        if len >= COUNTED_FROM && len > self.largest {
            self.bytes.fetch_add(len - self.largest, Relaxed);
            self.largest = len;
        }
    }
}

impl<B> Drop for CountedBody<B> {
    fn drop(&mut self) {
        self.bytes.fetch_sub(self.largest, Relaxed);
    }
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
        let polled = Pin::new(&mut this.inner).poll_frame(cx);
        if let Poll::Ready(Some(Ok(frame))) = &polled {
            if let Some(data) = frame.data_ref() {
                this.saw(data.len() as u64);
            }
        }
        polled
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
    fn a_body_counts_its_largest_chunk_until_dropped() {
        let bytes = Arc::new(AtomicU64::new(0));
        let mut body = CountedBody::new(http_body_util_empty(), bytes.clone());
        body.saw(1 << 20);
        body.saw(300 << 10);
        assert_eq!(
            bytes.load(Relaxed),
            1 << 20,
            "the buffer keeps its largest size"
        );
        body.saw(2 << 20);
        body.saw(100);
        assert_eq!(bytes.load(Relaxed), 2 << 20);
        let mut other = CountedBody::new(http_body_util_empty(), bytes.clone());
        other.saw(1 << 20);
        assert_eq!(bytes.load(Relaxed), 3 << 20);
        drop(body);
        drop(other);
        assert_eq!(bytes.load(Relaxed), 0);
    }

    fn http_body_util_empty() -> tonic::body::Body {
        tonic::body::Body::empty()
    }
}
