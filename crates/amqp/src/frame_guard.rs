//! Guards lapin's frame parser against hostile header tables: every connection redeliver opens
//! reads its socket through [`GuardedStream`], which rewrites a content-header frame whose
//! `headers` nest deeper than [`MAX_HEADER_DEPTH`] (or do not fit the negotiated frame size)
//! before lapin sees it.
//!
//! Why below lapin: lapin parses every frame on its I/O thread, a plain thread it spawns itself
//! (2 MiB of stack, no setting for it), with amq-protocol-types' recursive
//! `parse_field_table` / `parse_field_array`, which have no depth limit. With
//! amq-protocol-types 10.6.3 that thread overflows its stack, and the process aborts, at 233
//! nested arrays (205 tables) in a debug build and 1,403 (1,144) in release; one 131072-byte
//! frame holds 26,208 levels, and RabbitMQ 3.10.8's management API published a header nested
//! 3,000,000 deep (6 MB, no frame limit there). No stack fits the second, and a smaller
//! `frame_max` would not help: the broker sends a content header in one frame whatever its size.
//! So the depth is bounded before the parser runs: a scan without recursion finds each
//! top-level header's depth and length, and an entry nested deeper than the limit is replaced
//! by a string saying so. Everything else passes through unchanged, body frames without a copy
//! (see docs/upstream/amq-protocol-nested-field-table-stack-overflow.md). The frame boundaries
//! are followed by [`crate::framing`]'s filter, the one under the AMQP 1.0 guard too.
//!
//! The same scan repairs the short strings a publisher writes and lapin refuses when they are not
//! UTF-8 (RabbitMQ does not check them): properties such as `message_id` or `content_type`, and
//! the exchange and routing key of `basic.deliver`, `basic.get-ok` and `basic.return`. lapin's
//! parser fails on them and closes the connection; the message goes back to the head of the queue
//! and closes the next connection too, so one message stops every consumer. Each invalid byte
//! becomes `?`, which keeps every length (a frame never grows past the size it came in).
//!
//! A rewritten message carries [`HEADERS_REMOVED`], saying what was removed or repaired; the worker
//! dead-letters such a message (its own copy in the broker keeps the original headers), the CLI
//! shows it. The header is stripped from anything received, so it always means "altered on this
//! receipt", never what a publisher claims.

use std::fmt;
use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::task::{ready, Context, Poll};
use std::time::{Duration, Instant};

use async_rs::traits::Reactor;
use async_rs::util::RuntimeParts;
use async_rs::{Runtime, Tokio};
use futures::io::{AsyncRead, AsyncWrite};
use futures::Stream;
use lapin::tcp::{AMQPUriTcpExt, AsyncTcpStream, OwnedTLSConfig};
use lapin::types::{AMQPValue, FieldTable};
use lapin::uri::AMQPUri;
use lapin::{Connection, ConnectionProperties};

use crate::framing::{FrameFilter, FrameRules, Route};

/// How deep a header value may nest (a top-level array or table is level 1) before it is
/// removed on receipt. Real headers nest 3 levels (`x-death`: an array of tables of arrays);
/// at 32 levels lapin's parser needs about 300 KiB of stack in a debug build, well within the
/// 2 MiB of its I/O thread, and our own code (clone, drop, encoding, rendering) as little.
pub const MAX_HEADER_DEPTH: usize = 32;

/// Set on a message whose headers or properties were rewritten on receipt: a `longstr` saying
/// which headers were removed, or which properties repaired, and why. See [`headers_removed`].
pub const HEADERS_REMOVED: &str = "x-redeliver-headers-removed";

/// Headers of a delivery were removed on receipt (nested too deep, too large, unreadable), or
/// properties repaired (not UTF-8): the message cannot be taken apart as it was sent.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct HeadersRemoved(pub String);

/// Why headers of this delivery were removed on receipt, if they were.
pub fn headers_removed(headers: Option<&FieldTable>) -> Option<HeadersRemoved> {
    let value = headers?.inner().get(HEADERS_REMOVED)?;
    let text = match value {
        AMQPValue::LongString(s) => String::from_utf8_lossy(s.as_bytes()).into_owned(),
        other => format!("{other:?}"),
    };
    Some(HeadersRemoved(text))
}

const FRAME_METHOD: u8 = 1;
const FRAME_HEADER: u8 = 2;
const FRAME_BODY: u8 = 3;
const FRAME_HEARTBEAT_OLD: u8 = 4;
const FRAME_HEARTBEAT: u8 = 8;
const FRAME_END: u8 = 0xCE;
/// Type, channel, size.
const FRAME_HEAD: usize = 7;
/// Head and end byte around a payload.
const FRAME_OVERHEAD: usize = 8;
/// The `headers` bit of the basic class's property flags.
const HEADERS_FLAG: u16 = 1 << 13;
/// Class 10 (connection), method 30 (tune).
const CONNECTION_TUNE: [u8; 4] = [0, 10, 0, 30];
/// How many removed header names the marker lists.
const NAMES_LISTED: usize = 8;

/// The AMQP 0-9-1 frames the guard holds and rewrites: a [`FrameFilter`] over these is the
/// guard.
pub(crate) struct Rules {
    /// The frame size a rewritten frame must fit (0: no limit): the broker's, from
    /// `connection.tune`, or the client's own lower one.
    frame_max: u32,
    client_frame_max: u32,
}

impl fmt::Debug for Rules {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Rules")
            .field("frame_max", &self.frame_max)
            .finish_non_exhaustive()
    }
}

/// The byte-level rewriter: frames in, frames out.
pub(crate) type FrameGuard = FrameFilter<Rules>;

/// A guard for a client asking for `client_frame_max` (0: the broker's).
pub(crate) fn frame_guard(client_frame_max: u32) -> FrameGuard {
    FrameFilter::new(Rules {
        frame_max: client_frame_max,
        client_frame_max,
    })
}

impl FrameRules for Rules {
    /// Type, channel, size.
    const HEAD: usize = FRAME_HEAD;

    fn frames_start_with(&self, first: u8) -> bool {
        // Otherwise `AMQP` and a version: the broker refuses ours. Not frames to guard.
        matches!(
            first,
            FRAME_METHOD | FRAME_HEADER | FRAME_BODY | FRAME_HEARTBEAT_OLD | FRAME_HEARTBEAT
        )
    }

    fn route(&mut self, head: &[u8]) -> Route {
        let size = u32::from_be_bytes([head[3], head[4], head[5], head[6]]) as usize;
        // The payload and the end byte.
        let rest = size.saturating_add(1);
        // Content headers are the frames that can nest or carry a publisher's properties;
        // method frames carry `connection.tune` (channel 0) and a publisher's exchange and
        // routing key (`basic.deliver`). Both are small and held whole; bodies pass through.
        if head[0] == FRAME_HEADER || head[0] == FRAME_METHOD {
            Route::Hold(rest)
        } else {
            Route::Pass(rest)
        }
    }

    /// A held frame is complete: look at it, then hand it (or its rewrite) on.
    fn release(&mut self, frame: &mut [u8], out: &mut Vec<u8>) {
        let (head, held) = frame.split_at(FRAME_HEAD);
        let (payload, end) = held.split_at(held.len() - 1);
        let channel = u16::from_be_bytes([head[1], head[2]]);
        if end == [FRAME_END] {
            let rewritten = if head[0] == FRAME_METHOD {
                if channel == 0 {
                    self.note_tune(payload);
                    None
                } else {
                    sanitize_method(payload)
                }
            } else {
                sanitize_content_header(payload, self.frame_max)
            };
            if let Some(rewritten) = rewritten {
                out.extend_from_slice(&head[..3]);
                // A rewrite fits the frame size (checked), so its size fits a u32.
                out.extend_from_slice(
                    &u32::try_from(rewritten.len())
                        .unwrap_or(u32::MAX)
                        .to_be_bytes(),
                );
                out.extend_from_slice(&rewritten);
                out.push(FRAME_END);
                return;
            }
        }
        // Unchanged (a frame without its end byte is lapin's to report).
        out.extend_from_slice(frame);
    }
}

impl Rules {
    /// `connection.tune` carries the broker's frame size; lapin takes the lower of it and its own.
    fn note_tune(&mut self, payload: &[u8]) {
        if payload.len() >= 10 && payload[..4] == CONNECTION_TUNE {
            let broker = u32::from_be_bytes([payload[6], payload[7], payload[8], payload[9]]);
            self.frame_max = match (broker, self.client_frame_max) {
                (0, c) => c,
                (b, 0) => b,
                (b, c) => b.min(c),
            };
        }
    }
}

/// The basic class's properties in wire order, by flag bit: what each one is on the wire.
#[derive(Clone, Copy)]
enum Property {
    /// A short string, named as lapin names the property.
    Short(&'static str),
    /// The header table.
    Table,
    /// A fixed number of bytes (delivery mode and priority 1, timestamp 8).
    Fixed(usize),
}

const PROPERTIES: [Property; 14] = [
    Property::Short("content_type"),
    Property::Short("content_encoding"),
    Property::Table,
    Property::Fixed(1),
    Property::Fixed(1),
    Property::Short("correlation_id"),
    Property::Short("reply_to"),
    Property::Short("expiration"),
    Property::Short("message_id"),
    Property::Fixed(8),
    Property::Short("type"),
    Property::Short("user_id"),
    Property::Short("app_id"),
    Property::Short("cluster_id"),
];

/// Copies the short string at `pos` of `buf` to `out`, every byte of it that is not part of
/// valid UTF-8 replaced by `?` (so the length does not change: a rewritten frame never grows
/// past the frame size it came in). Returns where it ends and whether it was repaired.
fn copy_short_string(buf: &[u8], pos: usize, out: &mut Vec<u8>) -> Option<(usize, bool)> {
    let len = *buf.get(pos)? as usize;
    let text = buf.get(pos + 1..pos + 1 + len)?;
    out.push(len as u8);
    if std::str::from_utf8(text).is_ok() {
        out.extend_from_slice(text);
        return Some((pos + 1 + len, false));
    }
    for chunk in text.utf8_chunks() {
        out.extend_from_slice(chunk.valid().as_bytes());
        out.extend(std::iter::repeat_n(b'?', chunk.invalid().len()));
    }
    Some((pos + 1 + len, true))
}

/// The payload of a method frame a publisher's text reaches (`basic.deliver`, `basic.get-ok`,
/// `basic.return`: exchange and routing key) with short strings that are not UTF-8 repaired,
/// or `None` when it can be passed on as it is. lapin's parser refuses such a string and closes
/// the connection; the message would come back at the head of the queue and close the next one.
fn sanitize_method(payload: &[u8]) -> Option<Vec<u8>> {
    let class_method = payload.get(..4)?;
    let layout: &[Option<usize>] = match class_method {
        // consumer tag; delivery tag and redelivered; exchange; routing key
        [0, 60, 0, 60] => &[None, Some(9), None, None],
        // delivery tag and redelivered; exchange; routing key (message count follows)
        [0, 60, 0, 71] => &[Some(9), None, None],
        // reply code; reply text; exchange; routing key
        [0, 60, 0, 50] => &[Some(2), None, None, None],
        _ => return None,
    };
    let mut out = payload[..4].to_vec();
    let mut pos = 4;
    let mut repaired = false;
    for field in layout {
        match field {
            Some(n) => {
                out.extend_from_slice(payload.get(pos..pos + n)?);
                pos += n;
            }
            None => {
                let (end, r) = copy_short_string(payload, pos, &mut out)?;
                repaired |= r;
                pos = end;
            }
        }
    }
    if !repaired {
        return None;
    }
    out.extend_from_slice(&payload[pos..]);
    Some(out)
}

/// The payload of a content-header frame rewritten so that lapin can parse it and its frame
/// fits `frame_max` (0: no limit), or `None` when it can be passed on as it is: headers nested
/// too deep or unreadable are replaced, short-string properties that are not UTF-8 repaired,
/// and [`HEADERS_REMOVED`] says what was done.
fn sanitize_content_header(payload: &[u8], frame_max: u32) -> Option<Vec<u8>> {
    // class, weight, body size, property flags.
    let flags = u16::from_be_bytes([*payload.get(12)?, *payload.get(13)?]);
    let mut before = payload[..14].to_vec();
    let mut after = Vec::new();
    let mut table_src = None;
    let mut repaired = Vec::new();
    let mut pos = 14;
    for (i, property) in PROPERTIES.iter().enumerate() {
        if flags & (1 << (15 - i)) == 0 {
            continue;
        }
        // content_type and content_encoding come before the headers, the rest after.
        let out = if i < 2 { &mut before } else { &mut after };
        match *property {
            Property::Table => {
                let table_len = read_u32(payload, pos)?;
                let end = (pos + 4).checked_add(table_len)?;
                if end > payload.len() {
                    // lapin reports a truncated table; nothing nests beyond the frame.
                    return None;
                }
                table_src = Some((pos + 4, end));
                pos = end;
            }
            Property::Fixed(n) => {
                out.extend_from_slice(payload.get(pos..pos + n)?);
                pos += n;
            }
            Property::Short(name) => {
                let (end, r) = copy_short_string(payload, pos, out)?;
                if r {
                    repaired.push(name);
                }
                pos = end;
            }
        }
    }
    after.extend_from_slice(&payload[pos..]);
    let limit = match frame_max {
        0 => usize::MAX,
        n => (n as usize).saturating_sub(FRAME_OVERHEAD),
    };
    let rewrite = match table_src {
        Some((start, end)) => rewrite_table(&payload[start..end]),
        None => Ok(None),
    };
    if repaired.is_empty() && matches!(rewrite, Ok(None)) && payload.len() <= limit {
        return None;
    }
    let (table, table_note) = match rewrite {
        Ok(None) => (
            table_src.map_or_else(Vec::new, |(s, e)| payload[s..e].to_vec()),
            None,
        ),
        Ok(Some(rewritten)) => (rewritten.entries, rewritten.note),
        Err(Malformed) => (
            Vec::new(),
            Some("the header table cannot be read: removed on receipt".to_owned()),
        ),
    };
    let repaired_note = (!repaired.is_empty()).then(|| {
        format!(
            "properties that are not UTF-8 were repaired on receipt (each invalid byte \
             replaced by '?'): {}",
            repaired.join(", ")
        )
    });
    // The payload with `table` and the marker holding the notes, in this order.
    let assemble = |table: &[u8], table_note: Option<String>| {
        let notes: Vec<String> = table_note
            .into_iter()
            .chain(repaired_note.clone())
            .collect();
        let mut table = table.to_vec();
        if !notes.is_empty() {
            push_entry(&mut table, HEADERS_REMOVED.as_bytes(), &notes.join("; "));
        }
        let mut out = before.clone();
        if table_src.is_some() || !table.is_empty() {
            out[12..14].copy_from_slice(&(flags | HEADERS_FLAG).to_be_bytes());
            out.extend_from_slice(&u32::try_from(table.len()).unwrap_or(u32::MAX).to_be_bytes());
            out.extend_from_slice(&table);
        }
        out.extend_from_slice(&after);
        out
    };
    let rebuilt = assemble(&table, table_note);
    if rebuilt.len() <= limit {
        return Some(rebuilt);
    }
    let table_len = table_src.map_or(0, |(s, e)| e - s);
    Some(assemble(
        &[],
        Some(format!(
            "the header table ({table_len} bytes) does not fit the frame size ({frame_max} \
             bytes): removed on receipt"
        )),
    ))
}

/// A header table lapin cannot parse (truncated, an unknown type, a key that is not UTF-8).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Malformed;

fn push_entry(table: &mut Vec<u8>, key: &[u8], text: &str) {
    // Keys here are our own: far below the 255 bytes of a short string.
    table.push(u8::try_from(key.len()).unwrap_or(u8::MAX));
    table.extend_from_slice(&key[..key.len().min(255)]);
    push_long_string(table, text);
}

fn push_long_string(out: &mut Vec<u8>, text: &str) {
    out.push(b'S');
    out.extend_from_slice(&u32::try_from(text.len()).unwrap_or(u32::MAX).to_be_bytes());
    out.extend_from_slice(text.as_bytes());
}

/// A header table rewritten: its entries (without the marker) and what the marker should say.
struct RewrittenTable {
    entries: Vec<u8>,
    note: Option<String>,
}

/// The table body with every entry nested deeper than [`MAX_HEADER_DEPTH`] replaced by a string,
/// any incoming [`HEADERS_REMOVED`] dropped, and a note for the marker when something was
/// removed; `None` when nothing changes.
fn rewrite_table(body: &[u8]) -> Result<Option<RewrittenTable>, Malformed> {
    let mut out = Vec::new();
    let mut removed = Vec::new();
    let mut changed = false;
    let mut pos = 0;
    while pos < body.len() {
        let key_end = pos + 1 + body[pos] as usize;
        if key_end >= body.len() {
            return Err(Malformed);
        }
        let key = &body[pos + 1..key_end];
        // lapin's parser refuses a key that is not UTF-8 (a connection error, not a crash):
        // the table is replaced like any other it cannot read.
        std::str::from_utf8(key).map_err(|_| Malformed)?;
        let (value_end, depth) = value_extent(body, key_end)?;
        if key == HEADERS_REMOVED.as_bytes() {
            changed = true;
        } else if depth > MAX_HEADER_DEPTH {
            changed = true;
            out.extend_from_slice(&body[pos..key_end]);
            push_long_string(
                &mut out,
                &format!(
                    "removed by redeliver: nested deeper than {MAX_HEADER_DEPTH} levels ({} bytes)",
                    value_end - key_end
                ),
            );
            removed.push(String::from_utf8_lossy(key).into_owned());
        } else {
            out.extend_from_slice(&body[pos..value_end]);
        }
        pos = value_end;
    }
    if !changed {
        return Ok(None);
    }
    let mut note = None;
    if !removed.is_empty() {
        let mut names = removed
            .iter()
            .take(NAMES_LISTED)
            .map(String::as_str)
            .collect::<Vec<_>>()
            .join(", ");
        if removed.len() > NAMES_LISTED {
            names.push_str(&format!(" and {} more", removed.len() - NAMES_LISTED));
        }
        note = Some(format!(
            "headers nested deeper than {MAX_HEADER_DEPTH} levels were removed on receipt: {names}"
        ));
    }
    Ok(Some(RewrittenTable { entries: out, note }))
}

fn read_u32(buf: &[u8], pos: usize) -> Option<usize> {
    let b = buf.get(pos..pos.checked_add(4)?)?;
    Some(u32::from_be_bytes([b[0], b[1], b[2], b[3]]) as usize)
}

/// Where the field value at `pos` ends and how deep it nests (a scalar 0, `[]` 1), without
/// recursion. A container at a depth past [`MAX_HEADER_DEPTH`] is skipped by its length, unread:
/// the answer is then `MAX_HEADER_DEPTH + 1`. The type tags are amq-protocol-types' (RabbitMQ's).
fn value_extent(buf: &[u8], mut pos: usize) -> Result<(usize, usize), Malformed> {
    // End offset and kind (table or array) of each open container.
    let mut open: Vec<(usize, bool)> = Vec::new();
    let mut depth = 0;
    loop {
        let limit = open.last().map_or(buf.len(), |&(end, _)| end);
        let tag = *buf.get(pos).ok_or(Malformed)?;
        pos += 1;
        let fixed = match tag {
            b'V' => Some(0),
            b't' | b'b' | b'B' => Some(1),
            b's' | b'U' | b'u' => Some(2),
            b'I' | b'i' | b'f' => Some(4),
            b'D' => Some(5),
            b'l' | b'L' | b'd' | b'T' => Some(8),
            _ => None,
        };
        match (fixed, tag) {
            (Some(n), _) => pos += n,
            (None, b'S' | b'x') => pos += 4 + read_u32(buf, pos).ok_or(Malformed)?,
            (None, b'A' | b'F') => {
                let len = read_u32(buf, pos).ok_or(Malformed)?;
                let start = pos + 4;
                let end = start.checked_add(len).ok_or(Malformed)?;
                if end > limit {
                    return Err(Malformed);
                }
                if open.len() == MAX_HEADER_DEPTH {
                    depth = MAX_HEADER_DEPTH + 1;
                    pos = end;
                } else {
                    open.push((end, tag == b'F'));
                    depth = depth.max(open.len());
                    pos = start;
                }
            }
            _ => return Err(Malformed),
        }
        if pos > limit {
            return Err(Malformed);
        }
        // To the next value: close finished containers, read a table entry's key.
        loop {
            match open.last() {
                None => return Ok((pos, depth)),
                Some(&(end, is_table)) => {
                    if pos == end {
                        open.pop();
                        continue;
                    }
                    if is_table {
                        let key_end = pos + 1 + *buf.get(pos).ok_or(Malformed)? as usize;
                        if key_end >= end {
                            return Err(Malformed);
                        }
                        std::str::from_utf8(&buf[pos + 1..key_end]).map_err(|_| Malformed)?;
                        pos = key_end;
                    }
                    break;
                }
            }
        }
    }
}

/// A socket read through a [`FrameGuard`]; writes go through untouched.
pub(crate) struct GuardedStream<S> {
    inner: S,
    guard: FrameGuard,
    scratch: Box<[u8]>,
}

/// What one read from the socket takes at most, when the guard looks at the bytes.
const SCRATCH: usize = 16 * 1024;

impl<S> GuardedStream<S> {
    pub(crate) fn new(inner: S, client_frame_max: u32) -> Self {
        Self {
            inner,
            guard: frame_guard(client_frame_max),
            scratch: vec![0; SCRATCH].into_boxed_slice(),
        }
    }
}

impl<S> fmt::Debug for GuardedStream<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("GuardedStream")
            .field("guard", &self.guard)
            .finish_non_exhaustive()
    }
}

impl<S: AsyncRead + Unpin> AsyncRead for GuardedStream<S> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut [u8],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        if buf.is_empty() {
            return Poll::Ready(Ok(0));
        }
        loop {
            let pending = this.guard.pending();
            if !pending.is_empty() {
                let n = pending.len().min(buf.len());
                buf[..n].copy_from_slice(&pending[..n]);
                this.guard.consume(n);
                return Poll::Ready(Ok(n));
            }
            // Inside a frame passed as it is (a body, most bytes): straight into lapin's buffer.
            let direct = this.guard.direct();
            if direct > 0 {
                let n = direct.min(buf.len());
                let read = ready!(Pin::new(&mut this.inner).poll_read(cx, &mut buf[..n]))?;
                this.guard.passed_directly(read);
                return Poll::Ready(Ok(read));
            }
            let read = ready!(Pin::new(&mut this.inner).poll_read(cx, &mut this.scratch))?;
            if read == 0 {
                return Poll::Ready(Ok(0));
            }
            this.guard.feed(&this.scratch[..read]);
        }
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for GuardedStream<S> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().inner).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().inner).poll_write_vectored(cx, bufs)
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_flush(cx)
    }

    fn poll_close(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_close(cx)
    }
}

/// lapin's tokio reactor with sockets read through the guard. lapin names its socket type by
/// the reactor's, so the guard has to be the reactor's socket; only [`connect`]'s own connect
/// function makes them (with TLS under the guard when the URL asks for it).
#[derive(Clone, Debug)]
pub(crate) struct GuardedReactor {
    inner: Tokio,
}

type TokioSocket = <Tokio as Reactor>::TcpStream;

impl Reactor for GuardedReactor {
    type TcpStream = GuardedStream<AsyncTcpStream<TokioSocket>>;
    type Sleep = <Tokio as Reactor>::Sleep;

    // The trait's bound is async-rs' `AsSysFd`, which it does not export: these are its
    // supertraits, and its blanket impl makes them enough for the inner reactor.
    #[cfg(unix)]
    fn register<
        H: io::Read
            + io::Write
            + std::os::unix::io::AsFd
            + std::os::unix::io::AsRawFd
            + Send
            + 'static,
    >(
        &self,
        socket: H,
    ) -> io::Result<impl AsyncRead + AsyncWrite + Send + Unpin + 'static> {
        self.inner.register(socket)
    }

    #[cfg(windows)]
    fn register<
        H: io::Read
            + io::Write
            + std::os::windows::io::AsSocket
            + std::os::windows::io::AsRawSocket
            + Send
            + 'static,
    >(
        &self,
        socket: H,
    ) -> io::Result<impl AsyncRead + AsyncWrite + Send + Unpin + 'static> {
        self.inner.register(socket)
    }

    fn sleep(&self, dur: Duration) -> Self::Sleep {
        self.inner.sleep(dur)
    }

    fn interval(&self, dur: Duration) -> impl Stream<Item = Instant> + Send + 'static {
        self.inner.interval(dur)
    }

    fn tcp_connect_addr(
        &self,
        addr: SocketAddr,
    ) -> impl std::future::Future<Output = io::Result<Self::TcpStream>> + Send + 'static {
        let connecting = self.inner.tcp_connect_addr(addr);
        async move {
            Ok(GuardedStream::new(
                AsyncTcpStream::Plain(connecting.await?),
                0,
            ))
        }
    }
}

/// Connects as lapin's `Connection::connect_uri_with_config` does on the current tokio runtime,
/// with the broker's bytes read through the guard (above TLS, so it sees frames).
pub(crate) async fn connect(
    uri: AMQPUri,
    props: ConnectionProperties,
    tls: OwnedTLSConfig,
) -> lapin::Result<Connection> {
    let tokio = Tokio::current();
    let plain = Runtime::new(tokio.clone());
    let runtime = Runtime::new(RuntimeParts::new(
        tokio.clone(),
        GuardedReactor { inner: tokio },
    ));
    let client_frame_max = uri.query.frame_max.unwrap_or(0);
    Connection::connector(
        uri,
        runtime,
        async move |uri: AMQPUri, _runtime| {
            let socket = AMQPUriTcpExt::connect_with_config_async(&uri, tls.as_ref(), &plain)
                .await
                .map_err(lapin::Error::from)?;
            Ok(AsyncTcpStream::Plain(GuardedStream::new(
                socket,
                client_frame_max,
            )))
        },
        props,
    )
    .await
}

#[cfg(test)]
mod tests {
    use super::*;
    use amq_protocol::frame::{parse_frame, AMQPFrame};

    /// RabbitMQ's default `frame_max`, the largest content header it accepts over AMQP.
    const FRAME_MAX: u32 = 131_072;

    /// A value nesting `depth` arrays (`A`), tables (`F`, one entry `k` each) or both in turn
    /// (`M`), written without recursion.
    fn nested(kind: u8, depth: usize) -> Vec<u8> {
        let tag = |i: usize| match kind {
            b'M' if i % 2 == 1 => b'F',
            b'M' => b'A',
            k => k,
        };
        // Bytes of level i's own opening: tag, length, and a key when its parent is a table.
        let mut sizes = vec![0usize; depth + 1];
        for i in (0..depth).rev() {
            let key = if i + 1 < depth && tag(i) == b'F' {
                2
            } else {
                0
            };
            sizes[i] = if i + 1 < depth {
                key + 5 + sizes[i + 1]
            } else {
                0
            };
        }
        let mut v = Vec::new();
        for (i, size) in sizes.iter().take(depth).enumerate() {
            v.push(tag(i));
            v.extend_from_slice(&(*size as u32).to_be_bytes());
            if i + 1 < depth && tag(i) == b'F' {
                v.extend_from_slice(&[1, b'k']);
            }
        }
        v
    }

    fn entry(key: &str, value: &[u8]) -> Vec<u8> {
        let mut e = vec![key.len() as u8];
        e.extend_from_slice(key.as_bytes());
        e.extend_from_slice(value);
        e
    }

    /// A content-header frame on channel 1 with a content type and these header entries.
    fn header_frame(entries: &[Vec<u8>]) -> Vec<u8> {
        let table: Vec<u8> = entries.concat();
        let mut payload = vec![0, 60, 0, 0, 0, 0, 0, 0, 0, 0, 0, 3];
        payload.extend_from_slice(&((1u16 << 15) | HEADERS_FLAG | (1 << 12)).to_be_bytes());
        payload.extend_from_slice(&[4, b'j', b's', b'o', b'n']);
        payload.extend_from_slice(&(table.len() as u32).to_be_bytes());
        payload.extend_from_slice(&table);
        payload.push(2); // delivery mode, after the headers
        frame(FRAME_HEADER, 1, &payload)
    }

    /// Appends `s` as an AMQP short string (a length byte, then the bytes as they are).
    fn short(p: &mut Vec<u8>, s: &[u8]) {
        p.push(s.len() as u8);
        p.extend_from_slice(s);
    }

    fn frame(kind: u8, channel: u16, payload: &[u8]) -> Vec<u8> {
        let mut f = vec![kind];
        f.extend_from_slice(&channel.to_be_bytes());
        f.extend_from_slice(&(payload.len() as u32).to_be_bytes());
        f.extend_from_slice(payload);
        f.push(FRAME_END);
        f
    }

    fn tune(frame_max: u32) -> Vec<u8> {
        let mut p = CONNECTION_TUNE.to_vec();
        p.extend_from_slice(&2047u16.to_be_bytes());
        p.extend_from_slice(&frame_max.to_be_bytes());
        p.extend_from_slice(&60u16.to_be_bytes());
        frame(FRAME_METHOD, 0, &p)
    }

    /// What the parser gets for `input` fed in chunks of `chunk` bytes.
    fn through(input: &[u8], chunk: usize) -> Vec<u8> {
        let mut g = frame_guard(0);
        let mut out = Vec::new();
        for c in input.chunks(chunk) {
            g.feed(c);
            out.extend_from_slice(g.pending());
            let n = g.pending().len();
            g.consume(n);
        }
        out
    }

    /// Parses on a thread with half the stack lapin's I/O thread has (2 MiB): what passes the
    /// guard parses, is cloned, encoded and dropped with room to spare, in debug and release.
    fn parse_small_stack(bytes: Vec<u8>) -> Vec<AMQPFrame> {
        std::thread::Builder::new()
            .stack_size(1 << 20)
            .spawn(move || {
                let mut rest = &bytes[..];
                let mut frames = Vec::new();
                while !rest.is_empty() {
                    let (r, f) = parse_frame(rest).expect("the guard's output parses");
                    let copy = f.clone();
                    let mut buf = vec![0u8; 1 << 20];
                    let cursor = std::io::Cursor::new(&mut buf[..]);
                    amq_protocol::frame::gen_frame(&copy)(amq_protocol::frame::WriteContext::from(
                        cursor,
                    ))
                    .expect("encodes");
                    drop(copy);
                    frames.push(f);
                    rest = r;
                }
                frames
            })
            .unwrap()
            .join()
            .unwrap()
    }

    fn headers(frame: &AMQPFrame) -> FieldTable {
        match frame {
            AMQPFrame::Header(_, h) => h.properties.headers().clone().unwrap(),
            other => panic!("not a header frame: {other:?}"),
        }
    }

    #[test]
    fn the_deepest_headers_a_frame_holds_are_cut_to_the_limit() {
        // 26,208 arrays fill a 131072-byte frame; tables 18,720; mixed in between.
        for (kind, mut depth) in [(b'A', 26_214), (b'F', 18_725), (b'M', 21_846)] {
            let build = |depth| {
                let deep = nested(kind, depth);
                [
                    tune(FRAME_MAX),
                    header_frame(&[entry("h", &deep), entry("ok", b"t\x01")]),
                ]
                .concat()
            };
            let mut input = build(depth);
            while input.len() - tune(FRAME_MAX).len() > FRAME_MAX as usize {
                depth -= 1;
                input = build(depth);
            }
            eprintln!("{} levels of {}", depth, kind as char);
            let out = through(&input, 4096);
            let frames = parse_small_stack(out);
            let h = headers(&frames[1]);
            let removed = headers_removed(Some(&h)).expect("marked").0;
            assert!(
                removed.contains("deeper than 32 levels") && removed.contains(": h"),
                "{removed}"
            );
            assert!(matches!(h.inner().get("h"), Some(AMQPValue::LongString(_))));
            assert_eq!(h.inner().get("ok"), Some(&AMQPValue::Boolean(true)));
        }
    }

    #[test]
    fn nesting_up_to_the_limit_passes_unchanged_and_parses() {
        for kind in [b'A', b'F', b'M'] {
            let input = header_frame(&[entry("h", &nested(kind, MAX_HEADER_DEPTH))]);
            assert_eq!(through(&input, 7), input);
            let h = headers(&parse_small_stack(input)[0]);
            assert!(headers_removed(Some(&h)).is_none());
            let over = header_frame(&[entry("h", &nested(kind, MAX_HEADER_DEPTH + 1))]);
            let h = headers(&parse_small_stack(through(&over, 7))[0]);
            assert!(headers_removed(Some(&h)).is_some());
        }
    }

    #[test]
    fn chunking_does_not_change_the_output() {
        let body = frame(FRAME_BODY, 1, &[7u8; 5000]);
        let input = [
            tune(FRAME_MAX),
            header_frame(&[entry("a", &nested(b'A', 100))]),
            body.clone(),
            frame(FRAME_HEARTBEAT, 0, &[]),
            header_frame(&[entry("x-death", &nested(b'M', 3))]),
            body,
        ]
        .concat();
        let whole = through(&input, input.len());
        for chunk in [1, 2, 3, 7, 8, 100, 4096] {
            assert_eq!(through(&input, chunk), whole, "chunk {chunk}");
        }
        assert_eq!(parse_small_stack(whole).len(), 6);
    }

    /// A content-header frame on channel 1 whose short-string properties are these raw bytes:
    /// content type, message id and type (flags 15, 7, 5), and `headers` when given.
    fn props_frame(
        content_type: &[u8],
        message_id: &[u8],
        kind: &[u8],
        headers: Option<&[u8]>,
    ) -> Vec<u8> {
        let mut flags = (1u16 << 15) | (1 << 7) | (1 << 5);
        if headers.is_some() {
            flags |= HEADERS_FLAG;
        }
        let mut p = vec![0, 60, 0, 0, 0, 0, 0, 0, 0, 0, 0, 3];
        p.extend_from_slice(&flags.to_be_bytes());
        short(&mut p, content_type);
        if let Some(table) = headers {
            p.extend_from_slice(&(table.len() as u32).to_be_bytes());
            p.extend_from_slice(table);
        }
        short(&mut p, message_id);
        short(&mut p, kind);
        frame(FRAME_HEADER, 1, &p)
    }

    fn properties(frame: &AMQPFrame) -> lapin::BasicProperties {
        match frame {
            AMQPFrame::Header(_, h) => h.properties.clone(),
            other => panic!("not a header frame: {other:?}"),
        }
    }

    #[test]
    fn properties_that_are_not_utf8_are_repaired_and_marked() {
        // Without the guard lapin refuses the frame (and closes the connection).
        let input = props_frame(b"application/json", b"id-\xff\xfe-1", b"\xc3", None);
        assert!(parse_frame(&input[..]).is_err());
        for chunk in [1, 3, 7, 4096] {
            let frames = parse_small_stack(through(&input, chunk));
            let p = properties(&frames[0]);
            assert_eq!(p.message_id().as_ref().map(|s| s.as_str()), Some("id-??-1"));
            assert_eq!(p.kind().as_ref().map(|s| s.as_str()), Some("?"));
            assert_eq!(
                p.content_type().as_ref().map(|s| s.as_str()),
                Some("application/json")
            );
            let why = headers_removed(p.headers().as_ref()).expect("marked").0;
            assert!(
                why.contains("not UTF-8") && why.contains("message_id, type"),
                "{why}"
            );
            assert!(!why.contains("content_type"), "{why}");
        }
    }

    #[test]
    fn repaired_properties_and_cut_headers_are_both_named() {
        let table = [entry("deep", &nested(b'A', 100)), entry("keep", b"t\x01")].concat();
        let input = props_frame(b"text/\xff", b"ok", b"t", Some(&table));
        let p = properties(&parse_small_stack(through(&input, 64))[0]);
        assert_eq!(
            p.content_type().as_ref().map(|s| s.as_str()),
            Some("text/?")
        );
        let h = p.headers().clone().expect("headers");
        assert_eq!(h.inner().get("keep"), Some(&AMQPValue::Boolean(true)));
        let why = headers_removed(Some(&h)).expect("marked").0;
        assert!(
            why.contains("deeper than 32 levels") && why.contains("deep"),
            "{why}"
        );
        assert!(why.contains("content_type"), "{why}");
    }

    #[test]
    fn valid_properties_pass_unchanged() {
        let input = props_frame(
            "application/json; charset=é".as_bytes(),
            b"id-1",
            b"t",
            Some(&entry("a", b"t\x00")),
        );
        assert_eq!(through(&input, 5), input);
    }

    #[test]
    fn routing_keys_and_exchanges_that_are_not_utf8_are_repaired() {
        // basic.deliver: consumer tag, delivery tag, redelivered, exchange, routing key.
        let mut deliver = vec![0, 60, 0, 60];
        short(&mut deliver, b"ctag");
        deliver.extend_from_slice(&[0, 0, 0, 0, 0, 0, 0, 9, 1]);
        short(&mut deliver, b"ex\xff");
        short(&mut deliver, b"rk.\xe2\x82");
        // basic.get-ok: delivery tag, redelivered, exchange, routing key, message count.
        let mut get_ok = vec![0, 60, 0, 71, 0, 0, 0, 0, 0, 0, 0, 3, 0];
        short(&mut get_ok, b"");
        short(&mut get_ok, b"\x80q");
        get_ok.extend_from_slice(&5u32.to_be_bytes());
        // basic.return: reply code, reply text, exchange, routing key.
        let mut ret = vec![0, 60, 0, 50, 1, 56];
        short(&mut ret, b"NO_ROUTE");
        short(&mut ret, b"x");
        short(&mut ret, b"\xff");
        for payload in [&deliver, &get_ok, &ret] {
            assert!(parse_frame(&frame(FRAME_METHOD, 1, payload)[..]).is_err());
        }
        let input = [
            frame(FRAME_METHOD, 1, &deliver),
            frame(FRAME_METHOD, 1, &get_ok),
            frame(FRAME_METHOD, 1, &ret),
        ]
        .concat();
        let frames = parse_small_stack(through(&input, 3));
        let text = format!("{frames:?}");
        for expected in ["\"ex?\"", "\"rk.??\"", "\"?q\"", "\"ctag\"", "\"NO_ROUTE\""] {
            assert!(text.contains(expected), "{expected} in {text}");
        }
        // Other method frames, and valid ones, pass unchanged.
        let mut ok = vec![0, 60, 0, 60];
        short(&mut ok, b"ctag");
        ok.extend_from_slice(&[0, 0, 0, 0, 0, 0, 0, 9, 0]);
        short(&mut ok, b"");
        short(&mut ok, "q.é".as_bytes());
        let untouched = [
            frame(FRAME_METHOD, 1, &ok),
            frame(FRAME_METHOD, 1, &[0, 50, 0, 11, 0xff]),
        ]
        .concat();
        assert_eq!(through(&untouched, 2), untouched);
    }

    #[test]
    fn a_forged_marker_is_stripped() {
        let mut marker = vec![b'S'];
        marker.extend_from_slice(&4u32.to_be_bytes());
        marker.extend_from_slice(b"lies");
        let input = header_frame(&[entry(HEADERS_REMOVED, &marker), entry("b", b"t\x00")]);
        let h = headers(&parse_small_stack(through(&input, 5))[0]);
        assert!(headers_removed(Some(&h)).is_none());
        assert_eq!(h.inner().get("b"), Some(&AMQPValue::Boolean(false)));
    }

    #[test]
    fn a_table_larger_than_the_frame_size_is_replaced() {
        // Wide, not deep: 40,000 booleans (only the management API or a direct client gets
        // such a frame past the broker's limit).
        let wide: Vec<Vec<u8>> = (0..40_000)
            .map(|i| entry(&format!("k{i}"), b"t\x01"))
            .collect();
        let input = [tune(FRAME_MAX), header_frame(&wide)].concat();
        let out = through(&input, 1000);
        assert!(out.len() < 1000, "{}", out.len());
        let h = headers(&parse_small_stack(out)[1]);
        let why = headers_removed(Some(&h)).unwrap().0;
        assert!(
            why.contains("does not fit the frame size (131072 bytes)"),
            "{why}"
        );
    }

    #[test]
    fn malformed_tables_are_replaced_and_other_streams_pass() {
        // A table whose inner length runs past its end.
        let mut bad = vec![b'A'];
        bad.extend_from_slice(&1000u32.to_be_bytes());
        let out = through(&header_frame(&[entry("h", &bad)]), 3);
        let h = headers(&parse_small_stack(out)[0]);
        assert!(headers_removed(Some(&h))
            .unwrap()
            .0
            .contains("cannot be read"));
        // Keys that are not UTF-8, at the top and nested: lapin would refuse the frame.
        let mut inner = vec![b'F', 0, 0, 0, 3, 1, 0xFF, b'V'];
        for (key, value) in [("ok", &inner[..]), ("\u{0}", &b"V"[..])] {
            let mut e = entry(key, value);
            if key != "ok" {
                e[1] = 0xC3;
            }
            let out = through(&header_frame(&[e]), 3);
            let h = headers(&parse_small_stack(out)[0]);
            assert!(headers_removed(Some(&h))
                .unwrap()
                .0
                .contains("cannot be read"));
        }
        inner[6] = b'k';
        let fine = header_frame(&[entry("ok", &inner)]);
        assert_eq!(through(&fine, 3), fine);
        // The broker's protocol header (a version it prefers) is not frames: untouched.
        assert_eq!(through(b"AMQP\x00\x00\x09\x01", 1), b"AMQP\x00\x00\x09\x01");
        // No headers at all: untouched.
        let mut payload = vec![0, 60, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0x10, 0, 2];
        let plain = frame(FRAME_HEADER, 1, &payload);
        assert_eq!(through(&plain, 2), plain);
        payload.truncate(3);
        let short = frame(FRAME_HEADER, 1, &payload);
        assert_eq!(through(&short, 2), short);
    }
}

#[cfg(test)]
mod cost {
    use super::*;

    /// What the guard costs per delivery: `cargo test --release -p redeliver-amqp --lib
    /// frame_guard::cost -- --ignored --nocapture` (numbers in RELIABILITY.md).
    #[test]
    #[ignore = "a measurement, not a check"]
    fn cost_per_delivery() {
        // basic.deliver, a content header with 5 headers (x-death-like nesting), a 1 KiB body.
        let mut deliver = vec![0, 60, 0, 60, 3, b'c', b't', b'g'];
        deliver.extend_from_slice(&[0, 0, 0, 0, 0, 0, 0, 1, 0, 0, 1, b'q']);
        let mut table = Vec::new();
        for k in ["a", "b", "c", "d"] {
            table.extend_from_slice(&[1, k.as_bytes()[0], b'S', 0, 0, 0, 8]);
            table.extend_from_slice(b"12345678");
        }
        // x-death: an array of one table holding an array.
        table.extend_from_slice(&[1, b'x', b'A', 0, 0, 0, 21, b'F', 0, 0, 0, 16, 1, b'r']);
        table.extend_from_slice(&[b'A', 0, 0, 0, 10, b'S', 0, 0, 0, 5]);
        table.extend_from_slice(b"queue");
        let mut header = vec![0, 60, 0, 0, 0, 0, 0, 0, 0, 0, 4, 0, 0x20, 0];
        header.extend_from_slice(&(table.len() as u32).to_be_bytes());
        header.extend_from_slice(&table);
        let frame = |kind: u8, payload: &[u8]| {
            let mut f = vec![kind, 0, 1];
            f.extend_from_slice(&(payload.len() as u32).to_be_bytes());
            f.extend_from_slice(payload);
            f.push(FRAME_END);
            f
        };
        let one = [
            frame(FRAME_METHOD, &deliver),
            frame(FRAME_HEADER, &header),
            frame(FRAME_BODY, &[7; 1024]),
        ]
        .concat();
        let n = 200_000;
        let stream = one.repeat(n);
        let mut g = frame_guard(0);
        let mut sink = vec![0u8; 64 * 1024];
        let started = Instant::now();
        for chunk in stream.chunks(SCRATCH) {
            g.feed(chunk);
            while !g.pending().is_empty() {
                let m = g.pending().len().min(sink.len());
                sink[..m].copy_from_slice(&g.pending()[..m]);
                g.consume(m);
            }
        }
        let guarded = started.elapsed();
        let started = Instant::now();
        for chunk in stream.chunks(SCRATCH) {
            for c in chunk.chunks(sink.len()) {
                sink[..c.len()].copy_from_slice(c);
            }
        }
        let plain = started.elapsed();
        eprintln!(
            "{n} deliveries of {} bytes: guard {:.0} ns each, a plain copy {:.0} ns each",
            one.len(),
            guarded.as_nanos() as f64 / n as f64,
            plain.as_nanos() as f64 / n as f64
        );
        std::hint::black_box(&sink);
    }
}
