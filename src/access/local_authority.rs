//! The `:authority` of requests on the Unix socket, made one the HTTP/2 server accepts.
//!
//! gRPC clients as written (`grpc.insecure_channel("unix:/run/larder/larder.sock")` in grpcio
//! 1.57 and later, grpc-java, Bazel, older grpc-go) send the socket's path, or its
//! percent-encoding, as the request's `:authority`. That is no URI authority, and the HTTP/2
//! server (h2) resets every such request with PROTOCOL_ERROR before the daemon sees it. On a
//! Unix socket the authority names nothing (the socket is the address), so the client's bytes
//! are read here on their way to the server: every header block (HEADERS and its CONTINUATIONs)
//! is decoded and written again, an `:authority` that is not a valid authority replaced by
//! `localhost` (what grpc-go and Kubernetes send on a Unix socket); every other frame goes
//! through as it came. The blocks are written again without the dynamic table (each field a
//! literal, never indexed), so the server's view of the table never depends on the client's.

use std::pin::Pin;
use std::task::{Context, Poll};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

/// The HTTP/2 client preface, passed through before the first frame.
const PREFACE_LEN: usize = 24;
/// A frame's header: length (24 bits), type, flags, stream id.
const FRAME_HEADER: usize = 9;
const HEADERS: u8 = 0x1;
const CONTINUATION: u8 = 0x9;
const END_STREAM: u8 = 0x1;
const END_HEADERS: u8 = 0x4;
const PADDED: u8 = 0x8;
const PRIORITY: u8 = 0x20;
/// The largest frame the server takes before its SETTINGS say more (RFC 9113, 4.2): the
/// blocks written again are cut to it.
const MOST_FRAME: usize = 16_384;
/// The most bytes of one header block held while its CONTINUATIONs come, and the most its
/// fields may take decoded (RFC 7541's size: name, value and 32 a field): a request's headers
/// are a few hundred bytes (gRPC's own limit on metadata is 8 KiB). Past either the connection
/// is closed: one byte of HPACK can name a 4 KiB field of the client's table, so an unbounded
/// decode would let a client grow the daemon's memory a thousandfold from what it sent.
const MOST_BLOCK: usize = 64 << 10;
/// An output buffer kept past a read is given back to the allocator over this size.
const KEEP_OUT: usize = 64 << 10;
/// The HPACK dynamic table's size an HTTP/2 server allows unless its SETTINGS say otherwise.
const TABLE: usize = 4096;
/// What a Unix socket's requests say they are for when what they said is no authority.
const LOCAL: &[u8] = b"localhost";

/// A stream whose reads are the client's HTTP/2 bytes with every `:authority` made valid,
/// and whose writes go through untouched.
pub struct LocalAuthority<S> {
    inner: S,
    rewrite: Rewrite,
    /// Bytes read from `inner` and not yet taken by `rewrite`'s parser.
    read: Vec<u8>,
}

impl<S> LocalAuthority<S> {
    pub fn new(inner: S) -> LocalAuthority<S> {
        LocalAuthority {
            inner,
            rewrite: Rewrite::default(),
            read: vec![0; 16 << 10],
        }
    }

    pub fn get_ref(&self) -> &S {
        &self.inner
    }
}

impl<S: AsyncRead + Unpin> AsyncRead for LocalAuthority<S> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        let this = &mut *self;
        if buf.remaining() == 0 {
            return Poll::Ready(Ok(()));
        }
        loop {
            if this.rewrite.take_into(buf) {
                return Poll::Ready(Ok(()));
            }
            let mut read = ReadBuf::new(&mut this.read);
            match Pin::new(&mut this.inner).poll_read(cx, &mut read) {
                Poll::Ready(Ok(())) if read.filled().is_empty() => {
                    // The client closed: what is left of a frame is cut short for the server too.
                    return Poll::Ready(Ok(()));
                }
                Poll::Ready(Ok(())) => {
                    let n = read.filled().len();
                    if let Err(why) = this.rewrite.feed(&this.read[..n]) {
                        return Poll::Ready(Err(std::io::Error::new(
                            std::io::ErrorKind::InvalidData,
                            why,
                        )));
                    }
                }
                Poll::Ready(Err(e)) => return Poll::Ready(Err(e)),
                Poll::Pending => return Poll::Pending,
            }
        }
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for LocalAuthority<S> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

/// Where the parser is in the client's bytes.
#[derive(Default)]
enum At {
    /// In the preface, this many bytes of it still to pass.
    #[default]
    Preface,
    /// Between frames.
    Header,
    /// In a frame that passes as it is: this many bytes of its payload still to pass.
    Passing(usize),
}

/// The client-to-server bytes, parsed frame by frame: what is ready for the server in `out`.
pub struct Rewrite {
    at: At,
    preface_left: usize,
    /// Bytes of a frame header or of a header frame's payload, held until whole.
    pending: Vec<u8>,
    /// The header block being gathered: its HEADERS frame's stream, flags and priority.
    block: Option<Block>,
    decoder: loona_hpack::Decoder<'static>,
    out: Vec<u8>,
    out_at: usize,
}

impl Default for Rewrite {
    fn default() -> Self {
        // The client's table may grow to what the server allows it (SETTINGS_HEADER_TABLE_SIZE,
        // which the daemon leaves at its default), and no further.
        let mut decoder = loona_hpack::Decoder::new();
        decoder.set_max_allowed_table_size(TABLE);
        Rewrite {
            at: At::Preface,
            preface_left: PREFACE_LEN,
            pending: Vec::new(),
            block: None,
            decoder,
            out: Vec::new(),
            out_at: 0,
        }
    }
}

struct Block {
    stream: u32,
    end_stream: bool,
    priority: Option<[u8; 5]>,
    fragments: Vec<u8>,
}

impl Rewrite {
    /// Moves what is ready into `buf`; false when nothing was.
    fn take_into(&mut self, buf: &mut ReadBuf<'_>) -> bool {
        let ready = &self.out[self.out_at..];
        if ready.is_empty() || buf.remaining() == 0 {
            return false;
        }
        let n = ready.len().min(buf.remaining());
        buf.put_slice(&ready[..n]);
        self.out_at += n;
        if self.out_at == self.out.len() {
            if self.out.capacity() > KEEP_OUT {
                self.out = Vec::new();
            } else {
                self.out.clear();
            }
            self.out_at = 0;
        }
        true
    }

    /// Parses `bytes`, the next the client sent, into `out`.
    pub fn feed(&mut self, mut bytes: &[u8]) -> Result<(), String> {
        while !bytes.is_empty() {
            match self.at {
                At::Preface => {
                    let n = self.preface_left.min(bytes.len());
                    self.out.extend_from_slice(&bytes[..n]);
                    bytes = &bytes[n..];
                    self.preface_left -= n;
                    if self.preface_left == 0 {
                        self.at = At::Header;
                    }
                }
                At::Passing(left) => {
                    let n = left.min(bytes.len());
                    self.out.extend_from_slice(&bytes[..n]);
                    bytes = &bytes[n..];
                    self.at = if n == left {
                        At::Header
                    } else {
                        At::Passing(left - n)
                    };
                }
                At::Header => {
                    let want = if self.pending.len() < FRAME_HEADER {
                        FRAME_HEADER
                    } else {
                        FRAME_HEADER + frame_len(&self.pending)
                    };
                    let n = (want - self.pending.len()).min(bytes.len());
                    self.pending.extend_from_slice(&bytes[..n]);
                    bytes = &bytes[n..];
                    if self.pending.len() < want {
                        continue;
                    }
                    let kind = self.pending[3];
                    let len = frame_len(&self.pending);
                    if want == FRAME_HEADER && len > 0 && (kind == HEADERS || kind == CONTINUATION)
                    {
                        // The server's SETTINGS_MAX_FRAME_SIZE, which the daemon leaves at its
                        // default: h2 refuses a larger frame too.
                        if len > MOST_FRAME {
                            return Err(format!("a header frame of {len} bytes"));
                        }
                        continue; // its payload next
                    }
                    if kind == HEADERS || kind == CONTINUATION {
                        let frame = std::mem::take(&mut self.pending);
                        self.header_frame(&frame)?;
                        self.at = At::Header;
                    } else {
                        if self.block.is_some() {
                            return Err("a frame between a header block's frames".into());
                        }
                        self.out.append(&mut self.pending);
                        self.at = if len == 0 {
                            At::Header
                        } else {
                            At::Passing(len)
                        };
                    }
                }
            }
        }
        Ok(())
    }

    /// A whole HEADERS or CONTINUATION frame: its fragment gathered; at the block's end, the
    /// block written again.
    fn header_frame(&mut self, frame: &[u8]) -> Result<(), String> {
        let (kind, flags) = (frame[3], frame[4]);
        let stream = u32::from_be_bytes([frame[5], frame[6], frame[7], frame[8]]) & 0x7fff_ffff;
        let mut payload = &frame[FRAME_HEADER..];
        if kind == HEADERS {
            if self.block.is_some() {
                return Err("a HEADERS frame inside another's block".into());
            }
            if flags & PADDED != 0 {
                let (&pad, rest) = payload.split_first().ok_or("a padded frame of no bytes")?;
                payload = rest
                    .get(..rest.len().saturating_sub(pad as usize))
                    .filter(|_| (pad as usize) <= rest.len())
                    .ok_or("padding past the frame's end")?;
            }
            let priority = if flags & PRIORITY != 0 {
                let p: [u8; 5] = payload
                    .get(..5)
                    .and_then(|p| p.try_into().ok())
                    .ok_or("a priority past the frame's end")?;
                payload = &payload[5..];
                Some(p)
            } else {
                None
            };
            self.block = Some(Block {
                stream,
                end_stream: flags & END_STREAM != 0,
                priority,
                fragments: Vec::new(),
            });
        }
        let block = self
            .block
            .as_mut()
            .ok_or("a CONTINUATION frame outside a header block")?;
        if block.stream != stream {
            return Err("a CONTINUATION frame of another stream".into());
        }
        if block.fragments.len() + payload.len() > MOST_BLOCK {
            return Err("a header block past 64 KiB".into());
        }
        block.fragments.extend_from_slice(payload);
        if flags & END_HEADERS != 0 {
            let block = self.block.take().expect("gathered above");
            self.write_block(block)?;
        }
        Ok(())
    }

    /// The block's fields decoded, `:authority` made valid, written again as frames.
    fn write_block(&mut self, block: Block) -> Result<(), String> {
        let mut fields = Vec::new();
        let mut size = 0usize;
        self.decoder
            .decode_with_cb(&block.fragments, |name, value| {
                // Counted before anything is copied; past the limit nothing more is.
                size = size.saturating_add(name.len() + value.len() + 32);
                if size > MOST_BLOCK {
                    return;
                }
                if &*name == b":authority" && !is_authority(&value) {
                    literal(&mut fields, &name, LOCAL);
                } else {
                    literal(&mut fields, &name, &value);
                }
            })
            .map_err(|e| format!("a header block that does not decode: {e:?}"))?;
        if size > MOST_BLOCK {
            return Err(format!("header fields of {size} bytes decoded"));
        }
        let mut first = block.priority.map(Vec::from).unwrap_or_default();
        let room = MOST_FRAME - first.len();
        let (head, mut rest) = fields.split_at(fields.len().min(room));
        first.extend_from_slice(head);
        let mut flags = if block.end_stream { END_STREAM } else { 0 };
        if block.priority.is_some() {
            flags |= PRIORITY;
        }
        if rest.is_empty() {
            flags |= END_HEADERS;
        }
        self.frame(HEADERS, flags, block.stream, &first);
        while !rest.is_empty() {
            let (part, left) = rest.split_at(rest.len().min(MOST_FRAME));
            rest = left;
            let flags = if rest.is_empty() { END_HEADERS } else { 0 };
            self.frame(CONTINUATION, flags, block.stream, part);
        }
        Ok(())
    }

    fn frame(&mut self, kind: u8, flags: u8, stream: u32, payload: &[u8]) {
        let len = payload.len() as u32;
        self.out.extend_from_slice(&len.to_be_bytes()[1..]);
        self.out.push(kind);
        self.out.push(flags);
        self.out.extend_from_slice(&stream.to_be_bytes());
        self.out.extend_from_slice(payload);
    }
}

fn frame_len(header: &[u8]) -> usize {
    u32::from_be_bytes([0, header[0], header[1], header[2]]) as usize
}

/// Whether the HTTP/2 server takes `value` as a request's authority.
fn is_authority(value: &[u8]) -> bool {
    !value.is_empty() && http::uri::Authority::try_from(value).is_ok()
}

/// A field as a literal never added to the table, its name a literal too (RFC 7541, 6.2.2),
/// neither Huffman-coded.
fn literal(out: &mut Vec<u8>, name: &[u8], value: &[u8]) {
    out.push(0x00);
    string(out, name);
    string(out, value);
}

fn string(out: &mut Vec<u8>, s: &[u8]) {
    integer(out, s.len(), 7, 0x00);
    out.extend_from_slice(s);
}

/// An integer with an `n`-bit prefix (RFC 7541, 5.1), the prefix's byte starting with `first`.
fn integer(out: &mut Vec<u8>, mut v: usize, n: u32, first: u8) {
    let max = (1usize << n) - 1;
    if v < max {
        out.push(first | v as u8);
        return;
    }
    out.push(first | max as u8);
    v -= max;
    while v >= 128 {
        out.push((v % 128) as u8 | 0x80);
        v /= 128;
    }
    out.push(v as u8);
}

#[cfg(test)]
mod tests {
    use super::*;

    const PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";

    fn frame(kind: u8, flags: u8, stream: u32, payload: &[u8]) -> Vec<u8> {
        let mut f = (payload.len() as u32).to_be_bytes()[1..].to_vec();
        f.extend_from_slice(&[kind, flags]);
        f.extend_from_slice(&stream.to_be_bytes());
        f.extend_from_slice(payload);
        f
    }

    /// Frames out of `bytes` (after the preface): (type, flags, stream, payload).
    fn frames(mut bytes: &[u8]) -> Vec<(u8, u8, u32, Vec<u8>)> {
        assert_eq!(&bytes[..24], PREFACE);
        bytes = &bytes[24..];
        let mut out = vec![];
        while !bytes.is_empty() {
            let len = frame_len(bytes);
            let stream = u32::from_be_bytes(bytes[5..9].try_into().unwrap());
            out.push((bytes[3], bytes[4], stream, bytes[9..9 + len].to_vec()));
            bytes = &bytes[9 + len..];
        }
        out
    }

    /// The client's bytes through a `Rewrite`, `cut` bytes at a time.
    fn through(input: &[u8], cut: usize) -> Vec<u8> {
        let mut r = Rewrite::default();
        for part in input.chunks(cut) {
            r.feed(part).unwrap();
        }
        r.out[r.out_at..].to_vec()
    }

    fn request(authority: &[u8], enc: &mut loona_hpack::Encoder<'_>) -> Vec<u8> {
        enc.encode([
            (&b":method"[..], &b"POST"[..]),
            (b":scheme", b"http"),
            (b":path", b"/larder.v1.Larder/ListDatasets"),
            (b":authority", authority),
            (b"content-type", b"application/grpc"),
            (b"te", b"trailers"),
        ])
    }

    #[test]
    fn a_socket_path_as_authority_becomes_localhost_and_the_rest_passes_as_it_came() {
        let mut enc = loona_hpack::Encoder::new();
        let settings = frame(0x4, 0, 0, &[0, 3, 0, 0, 0, 100]);
        let first = request(b"%2Frun%2Flarder%2Flarder.sock", &mut enc);
        // The second request's fields come from the client's dynamic table.
        let second = request(b"/run/larder/larder.sock", &mut enc);
        let valid = request(b"localhost:50051", &mut enc);
        let data = frame(0x0, END_STREAM, 1, &[0, 0, 0, 0, 2, 8, 1]);
        // A block split over HEADERS and a CONTINUATION, padded and with a priority.
        let (a, b) = second.split_at(10);
        let mut padded = vec![3u8];
        padded.extend_from_slice(&[0, 0, 0, 0, 16]);
        padded.extend_from_slice(a);
        padded.extend_from_slice(&[0, 0, 0]);
        let input = [
            PREFACE.to_vec(),
            settings.clone(),
            frame(HEADERS, END_HEADERS, 1, &first),
            data.clone(),
            frame(HEADERS, PADDED | PRIORITY | END_STREAM, 3, &padded),
            frame(CONTINUATION, END_HEADERS, 3, b),
            frame(HEADERS, END_HEADERS | END_STREAM, 5, &valid),
        ]
        .concat();
        for cut in [1, 7, 9, 4096] {
            let got = frames(&through(&input, cut));
            assert_eq!(got.len(), 5, "cut {cut}");
            assert_eq!(got[0], (0x4, 0, 0, settings[9..].to_vec()));
            assert_eq!(got[2], (0x0, END_STREAM, 1, data[9..].to_vec()));
            // The server's decoder, fresh: the blocks written again need no table of the client's.
            let mut dec = loona_hpack::Decoder::new();
            let authority = |fields: &[(Vec<u8>, Vec<u8>)]| {
                fields
                    .iter()
                    .find(|(n, _)| n == b":authority")
                    .map(|(_, v)| v.clone())
            };
            for (i, stream, want) in [
                (1, 1, &b"localhost"[..]),
                (3, 3, b"localhost"),
                (4, 5, b"localhost:50051"),
            ] {
                let (kind, flags, s, payload) = &got[i];
                assert_eq!((*kind, *s), (HEADERS, stream));
                assert_ne!(flags & END_HEADERS, 0);
                let block = if flags & PRIORITY != 0 {
                    assert_eq!(&payload[..5], &[0, 0, 0, 0, 16]);
                    &payload[5..]
                } else {
                    &payload[..]
                };
                let fields = dec.decode(block).unwrap();
                assert_eq!(fields.len(), 6);
                assert_eq!(authority(&fields).as_deref(), Some(want));
                assert_eq!(fields[2].1, b"/larder.v1.Larder/ListDatasets");
            }
            assert_eq!(got[3].1 & END_STREAM, END_STREAM, "END_STREAM kept");
        }
    }

    #[test]
    fn a_block_past_a_frame_is_written_as_continuations() {
        let long = vec![b'x'; 40_000];
        // (40 KB of fields: within the decoded limit, over one frame.)
        let mut enc = loona_hpack::Encoder::new();
        let block = enc.encode([(&b":authority"[..], &b"/a/b"[..]), (b"x-long", &long[..])]);
        let mut input = PREFACE.to_vec();
        // As a client sends it: frames of at most the server's 16 KiB.
        let parts: Vec<&[u8]> = block.chunks(MOST_FRAME).collect();
        for (k, part) in parts.iter().enumerate() {
            let kind = if k == 0 { HEADERS } else { CONTINUATION };
            let flags = if k + 1 == parts.len() { END_HEADERS } else { 0 };
            input.extend(frame(kind, flags, 1, part));
        }
        let got = frames(&through(&input, 1000));
        assert_eq!(got.len(), 3);
        assert!(got
            .iter()
            .all(|(_, _, s, p)| *s == 1 && p.len() <= MOST_FRAME));
        assert_eq!(got[0].0, HEADERS);
        assert_eq!((got[2].0, got[2].1), (CONTINUATION, END_HEADERS));
        let whole: Vec<u8> = got.iter().flat_map(|f| f.3.clone()).collect();
        let fields = loona_hpack::Decoder::new().decode(&whole).unwrap();
        assert_eq!(fields[0].1, b"localhost");
        assert_eq!(fields[1].1, long);
    }

    #[test]
    fn what_does_not_hold_closes_the_connection() {
        let mut enc = loona_hpack::Encoder::new();
        let block = request(b"/x", &mut enc);
        let other_stream = [
            PREFACE.to_vec(),
            frame(HEADERS, 0, 1, &block[..5]),
            frame(CONTINUATION, END_HEADERS, 3, &block[5..]),
        ]
        .concat();
        let between = [
            PREFACE.to_vec(),
            frame(HEADERS, 0, 1, &block[..5]),
            frame(0x0, 0, 1, b"x"),
        ]
        .concat();
        let huge = [PREFACE.to_vec(), vec![0x10, 0, 0, HEADERS, 0, 0, 0, 0, 1]].concat();
        let garbage = [PREFACE.to_vec(), frame(HEADERS, END_HEADERS, 1, &[0xff; 8])].concat();
        // A dynamic table of 1 GiB asked for (a size update, 0x3f then 2^30 - 31 in 7-bit groups).
        let mut grow = vec![0x3f];
        let mut v = (1usize << 30) - 31;
        while v >= 128 {
            grow.push((v % 128) as u8 | 0x80);
            v /= 128;
        }
        grow.push(v as u8);
        grow.extend_from_slice(&block);
        let grow = [PREFACE.to_vec(), frame(HEADERS, END_HEADERS, 1, &grow)].concat();
        // A decompression bomb: a 4 KB field put in the client's table, then named by one byte
        // 5,000 times (20 MB decoded from 9 KB sent).
        let mut enc = loona_hpack::Encoder::new();
        let mut bomb = enc.encode([(&b"x-big"[..], &vec![b'a'; 4000][..])]);
        bomb.extend(std::iter::repeat_n(0xBE, 5000));
        let bomb = [
            PREFACE.to_vec(),
            frame(HEADERS, 0, 1, &bomb[..9000]),
            frame(CONTINUATION, END_HEADERS, 1, &bomb[9000..]),
        ]
        .concat();
        for bad in [other_stream, between, huge, garbage, grow, bomb] {
            assert!(Rewrite::default().feed(&bad).is_err());
        }
    }
}
