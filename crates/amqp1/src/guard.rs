//! Guards fe2o3-amqp's decoder against hostile nesting: every connection reads its socket
//! through [`GuardedStream`], which cuts a delivery whose payload nests deeper than
//! [`MAX_NESTING`] before fe2o3 sees it, and says why in [`Cuts`]. It also passes the arrays
//! fe2o3's decoder cannot read (RabbitMQ's `x-opt-deaths` among them) on as binaries, so those
//! messages decode (see "Arrays fe2o3 cannot read").
//!
//! # Why below fe2o3
//!
//! fe2o3-amqp 0.18.4 decodes a message with serde_amqp 0.18.0, whose deserializer recurses once
//! per list, map, array and described value, without a limit. A message whose sections nest a
//! few thousand levels (3,500 lists are about 30 KB, far below any frame or message size limit)
//! overflows the stack of the task that calls `Receiver::recv()`, and the process aborts
//! (a 2 MiB tokio worker thread; see `docs/upstream/fe2o3-amqp-decoder-recursion.md`). Anyone
//! who may publish to the queue can send one, and RabbitMQ passes the bytes on as they came. No
//! setting of fe2o3 bounds it, so the depth is bounded before its decoder runs.
//!
//! # What the guard reads
//!
//! Writes pass through untouched. Reads go through `redeliver_amqp::framing`'s frame filter,
//! the one under the 0-9-1 guard too, with this protocol's rules. They are AMQP 1.0 wire data
//! (OASIS AMQP 1.0, part 2): the 8-byte protocol headers (`AMQP` 3 1 0 0, then `AMQP` 0 1 0 0
//! after the SASL outcome), then frames: a 4-byte size, `doff`, type (0 AMQP, 1 SASL), channel,
//! extended header, body. Every frame is held whole (at most one at a time, up to
//! [`MAX_FRAME_SIZE`]) and passed on as it is, except the `transfer` performatives' payloads:
//! the bytes after the performative are a part of a message (part 3), which a delivery may
//! spread over several frames (`more`). For each link (channel and `handle`) a scanner without
//! recursion (`guard/scan.rs`) follows the payload's encoding (part 1: constructors, fixed and
//! variable widths, lists, maps, arrays whose elements share one constructor, described values)
//! across frame boundaries, and knows how deep the decoder will be at every byte. The only change it makes to a payload is the one byte of an
//! array turned into a binary, and the cut.
//!
//! # What a cut is
//!
//! Where a value would open level `MAX_NESTING + 1` (a section is a described value, level 1;
//! its map or list level 2; and so on), the rest of that delivery's payload is withheld: in this
//! frame from the offending value on, and in every later frame of the delivery. The frame keeps
//! its performative and gets its new size; its payload ends with one byte `0xFF`, a constructor
//! AMQP does not define, in place of the bytes withheld. The delivery-id goes into [`Cuts`] with
//! the reason, which [`Cuts::take`] hands out once.
//!
//! What fe2o3 then does, checked against RabbitMQ 4.0.5 and 4.3.6 (`tests/guard.rs`): the
//! decoder stops at the `0xFF` (serde_amqp's `InvalidFormatCode`), so `Receiver::recv()` returns
//! `RecvError::MessageDecode(MessageDecodeError { info, source })`. The link and the session
//! stay up, the delivery is in the link's unsettled map, and `info` (a `DeliveryInfo`) settles
//! it like any delivery: `receiver.modify(info, Modified { undeliverable_here: Some(true), .. })`
//! (dead-lettered by a quorum queue with a dead-letter target), `reject(info, error)` or
//! `release(info)`. With `CreditMode::Auto` that settlement also counts toward the credit refill.
//! Without the `0xFF` the payload would simply end early, which fails the same way when the cut
//! is inside a compound; the byte makes it fail wherever the cut is (a malformed compound can end
//! at a section boundary, where a bare end would decode as a shorter message).
//!
//! # Arrays fe2o3 cannot read
//!
//! serde_amqp 0.18.0 misreads valid AMQP arrays (`docs/upstream/serde_amqp-described-arrays.md`):
//! those whose element constructor is described (`0x00` descriptor constructor), a map, or,
//! with more than one element, a list or an array; empty arrays (they still have an element
//! constructor, which it does not read); and arrays of more zero-width elements (null, true,
//! 0, list0...) than bytes. It fails with `Invalid value`, `Invalid format code`, or a size
//! underflow (a panic in a debug build). RabbitMQ 4.x writes an array of maps on every message
//! that was ever dead-lettered (through a TTL, a dead-letter exchange, a delivery limit): the
//! message annotation `x-opt-deaths` (4.0.5 and 4.3.6: an array8 whose element constructor is
//! map32, `0xd1`; fe2o3 fails with `Invalid value`). Without the guard such a
//! message fails `Receiver::recv()` with `RecvError::MessageDecode`, and a worker can only
//! dead-letter it as undecodable.
//!
//! So the scanner turns each such array, wherever it is in the payload, into a binary of the
//! same size, in place: `0xe0` (array8: size u8, count u8, element constructor, elements)
//! becomes `0xa0` (vbin8, whose length is the array's size byte), `0xf0` (array32) `0xb0`
//! (vbin32). One byte changes; no size of a compound, section or frame does. The value
//! decodes as `Value::Binary` holding the array's count, element constructor and elements, as
//! they came (an application can read them with any AMQP 1.0 decoder); the worker shows such
//! a header or annotation as a byte array. Lists and arrays as elements become binaries
//! whatever the count (fe2o3 reads one by luck): the decision is taken from the element
//! constructor alone, at the array's head, and an array of arrays could not have only its
//! inner one rewritten (it has no constructor of its own). Arrays of primitives (fixed and
//! variable width, list0) pass as they are.
//!
//! A binary is not decoded, so it is no level, and nothing in it counts toward the depth. The
//! array's own constructor must still be in the frame being read when the element constructor
//! shows it is to be a binary (3 bytes further for an array8, 9 for an array32). If a transfer
//! frame ended in between, the constructor went out unchanged with that frame (the guard holds
//! one frame at a time), and fe2o3 would fail on the array anyway: the delivery is cut there,
//! with a reason saying so, and is settled like any cut one. RabbitMQ puts the message
//! annotations in the first frame of a delivery (256 KiB by default), so this concerns arrays
//! in a body or huge annotations whose head falls on a frame boundary.
//!
//! # Encodings the guard cannot follow
//!
//! An unknown constructor, a compound whose `size` and `count` disagree, a value that overruns
//! the compound around it: the delivery is cut there too, with a reason saying so. Only publishers
//! write such bytes (RabbitMQ re-encodes what it converts), serde_amqp would mostly refuse them
//! anyway, and a scanner that lost track of the structure can no longer say how deep the rest
//! goes; a cut keeps the depth bounded and the delivery settleable. A delivery whose payload just
//! ends inside a compound is passed as it is: nothing follows that could nest, and the decoder
//! fails on its end. Valid encodings are never cut unless too deep.
//!
//! The guard reads the broker's own frames (open, begin, attach, flow, disposition and the
//! transfer performatives themselves) without scanning them: RabbitMQ writes them, not a
//! publisher. A frame it cannot take apart (a size below 8, a bad `doff`) is passed on as it is
//! and everything after it too: fe2o3 fails on it and closes the connection. A frame larger than
//! [`MAX_FRAME_SIZE`] is passed on unread: fe2o3 refuses any frame larger than the
//! `max-frame-size` it announced (256 KiB unless set), which must stay at or below that bound.
//!
//! No code here panics, recurses or loops without consuming input; the memory per connection
//! is one frame, a 16-byte carry and a stack of at most [`MAX_NESTING`] + 1 entries per link
//! with a delivery in progress (an array one level too deep is open until its element
//! constructor shows whether it stays an array), and [`Cuts`] keeps the last [`MAX_CUTS`] reasons.

mod scan;

use std::collections::{HashMap, VecDeque};
use std::fmt;
use std::io;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{ready, Context, Poll};

use redeliver_amqp::framing::{FrameFilter, FrameRules, Route};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

use scan::{Scanner, Stop};

/// How many levels a message may nest, counted from a section (a section is a described value,
/// level 1; its map or list level 2; a value in it is level 3 if it is a list, map, array or
/// described value; and so on). Real messages nest a handful of levels. A message nesting 31
/// lists in its body needs about 315 KiB of stack to decode in a debug build (about 9 KiB per
/// level) and 27 KiB in release (about 0.6 KiB per level; see the upstream report): well
/// within the 2 MiB of a tokio worker thread, with room left for the application's own
/// recursive handling of the value (drop, clone, `Debug`).
pub const MAX_NESTING: usize = 32;

/// The largest frame the guard holds and reads; a larger one is passed on unread (fe2o3 refuses
/// frames over the `max-frame-size` it announced, by default 256 KiB).
pub const MAX_FRAME_SIZE: usize = 16 * 1024 * 1024;

/// How many cut deliveries [`Cuts`] remembers; older ones are forgotten.
pub const MAX_CUTS: usize = 1024;

/// The byte put where a delivery's payload was cut: a constructor AMQP does not define, so the
/// decoder fails there, wherever it is.
const CUT_MARK: u8 = 0xFF;
/// Size, doff, type, channel.
const FRAME_HEAD: usize = 8;
const PROTOCOL: [u8; 4] = *b"AMQP";
/// The `transfer` performative: descriptor code and name.
const TRANSFER_CODE: u64 = 0x14;
const TRANSFER_NAME: &[u8] = b"amqp:transfer:list";

/// The deliveries a [`GuardedStream`] cut, with why: shared between the stream (which records)
/// and the consumer (which takes). Keyed by delivery-id, which is unique within a session: give
/// each connection with more than one receiving session its own stream and `Cuts` per session
/// only if their ids cannot collide (one session per connection is the simple rule).
#[derive(Clone, Debug, Default)]
pub struct Cuts(Arc<CutLog>);

#[derive(Debug, Default)]
struct CutLog {
    /// How many reasons `log` holds, readable without the lock: [`Cuts::take`] runs for every
    /// delivery, and almost every delivery was not cut.
    held: AtomicUsize,
    log: Mutex<VecDeque<(u32, String)>>,
}

impl Cuts {
    /// An empty log.
    pub fn new() -> Self {
        Self::default()
    }

    /// Why delivery `delivery_id` was cut, if it was; each reason is handed out once.
    pub fn take(&self, delivery_id: u32) -> Option<String> {
        // A cut is recorded while its frame is read, before the decoder hands the delivery
        // over, so a delivery that was cut always finds `held` above zero here.
        if self.0.held.load(Ordering::Acquire) == 0 {
            return None;
        }
        let mut log = self.0.log.lock().unwrap_or_else(|e| e.into_inner());
        let at = log.iter().position(|(id, _)| *id == delivery_id)?;
        let why = log.remove(at).map(|(_, why)| why);
        self.0.held.store(log.len(), Ordering::Release);
        why
    }

    fn record(&self, delivery_id: u32, why: String) {
        let mut log = self.0.log.lock().unwrap_or_else(|e| e.into_inner());
        log.retain(|(id, _)| *id != delivery_id);
        if log.len() >= MAX_CUTS {
            log.pop_front();
        }
        log.push_back((delivery_id, why));
        self.0.held.store(log.len(), Ordering::Release);
    }
}

/// A delivery in progress on one link.
#[derive(Debug)]
struct InFlight {
    delivery_id: Option<u32>,
    scanner: Scanner,
    /// Why it is being cut, once it is.
    cut: Option<String>,
    /// Whether the cut mark went out (the first byte withheld; the rest goes without).
    marked: bool,
}

/// The AMQP 1.0 frames the guard reads and cuts: a [`FrameFilter`] over these is the guard.
pub(crate) struct Rules {
    links: HashMap<(u16, u32), InFlight>,
    cuts: Cuts,
}

impl fmt::Debug for Rules {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Rules")
            .field("deliveries_in_progress", &self.links.len())
            .finish_non_exhaustive()
    }
}

/// The byte-level guard: frames in, frames out.
pub(crate) type FrameGuard = FrameFilter<Rules>;

/// A guard that records the deliveries it cuts in `cuts`.
pub(crate) fn frame_guard(cuts: Cuts) -> FrameGuard {
    FrameFilter::new(Rules {
        links: HashMap::new(),
        cuts,
    })
}

impl FrameRules for Rules {
    /// A frame's size (or a protocol header's `AMQP`).
    const HEAD: usize = 4;

    fn route(&mut self, head: &[u8]) -> Route {
        let size = u32::from_be_bytes([head[0], head[1], head[2], head[3]]) as usize;
        if head == PROTOCOL {
            // A protocol header: `AMQP` and 4 bytes of id and version.
            Route::Pass(4)
        } else if size < FRAME_HEAD {
            // Framing is lost: everything passes, fe2o3 fails on it.
            Route::Transparent
        } else if size > MAX_FRAME_SIZE {
            // Passed on unread; fe2o3 refuses it.
            Route::Pass(size - Self::HEAD)
        } else {
            Route::Hold(size - Self::HEAD)
        }
    }

    /// A held frame is complete: look at it, then hand it (or its rewrite) on.
    fn release(&mut self, held: &mut [u8], out: &mut Vec<u8>) {
        if let Some(flow) = flow_without_delivery_count(held) {
            out.extend_from_slice(&flow);
            return;
        }
        match self.transfer_payload_end(held) {
            Some((keep, mark)) if keep < held.len() => {
                // `keep` is below the frame's size, which fits a u32.
                let size = u32::try_from(keep + usize::from(mark)).unwrap_or(u32::MAX);
                out.extend_from_slice(&size.to_be_bytes());
                out.extend_from_slice(&held[4..keep]);
                if mark {
                    out.push(CUT_MARK);
                }
            }
            _ => out.extend_from_slice(held),
        }
    }
}

impl Rules {
    /// For a `transfer` frame, scans its payload; `Some((n, mark))` when only the first `n`
    /// bytes of the frame may pass (the rest of the delivery is cut), followed by the cut mark
    /// if this is where the cut begins; `None` to pass it whole.
    fn transfer_payload_end(&mut self, frame: &mut [u8]) -> Option<(usize, bool)> {
        let doff = usize::from(*frame.get(4)?) * 4;
        let kind = *frame.get(5)?;
        if kind != 0 || doff < FRAME_HEAD || doff >= frame.len() {
            // SASL, a heartbeat (no body), or a frame fe2o3 refuses.
            return None;
        }
        let channel = u16::from_be_bytes([frame[6], frame[7]]);
        let body = &frame[doff..];
        let transfer = Transfer::parse(body)?;
        let key = (channel, transfer.handle);
        if transfer.aborted {
            // Its payload is ignored and the delivery discarded.
            self.links.remove(&key);
            return None;
        }
        let new = match self.links.get(&key) {
            None => true,
            Some(d) => transfer
                .delivery_id
                .is_some_and(|id| d.delivery_id != Some(id)),
        };
        if new {
            self.links.insert(
                key,
                InFlight {
                    delivery_id: transfer.delivery_id,
                    scanner: Scanner::default(),
                    cut: None,
                    marked: false,
                },
            );
        }
        let payload = &mut frame[doff + transfer.payload_start..];
        let flight = self.links.get_mut(&key)?;
        let keep = match (&flight.cut, flight.marked) {
            (Some(_), _) | (None, true) => Some(0),
            (None, false) => match flight.scanner.feed(payload) {
                Ok(()) => None,
                Err((at, stop)) => {
                    flight.cut = Some(reason(&stop));
                    Some(at)
                }
            },
        };
        let result = match keep {
            Some(at) if at < payload.len() => {
                let mark = !flight.marked;
                if mark {
                    // The first byte of this delivery withheld: say why, once.
                    flight.marked = true;
                    if let (Some(id), Some(why)) = (flight.delivery_id, flight.cut.take()) {
                        self.cuts.record(id, why);
                    }
                }
                Some((doff + transfer.payload_start + at, mark))
            }
            _ => None,
        };
        if !transfer.more {
            if let Some(done) = self.links.remove(&key) {
                let arrays = done.scanner.rewritten();
                if arrays > 0 {
                    tracing::debug!(
                        delivery_id = done.delivery_id,
                        arrays,
                        "AMQP 1.0 arrays fe2o3 cannot decode were passed on as binaries"
                    );
                }
            }
        }
        result
    }
}

/// The `flow` performative: descriptor code and name.
const FLOW_CODE: u64 = 0x13;
const FLOW_NAME: &[u8] = b"amqp:flow:list";
/// `delivery-count`'s place among a flow's fields.
const FLOW_DELIVERY_COUNT: usize = 5;

/// A link `flow` from the broker, rewritten without its `delivery-count` (null); `None` for any
/// other frame, or a flow that has none.
///
/// fe2o3-amqp 0.18.4 overwrites a receiver's delivery count with the one an incoming flow
/// carries, although it counts a transfer only when `recv` takes it: the transfers that wait
/// in it at that moment (RabbitMQ sends a flow right after the last transfer a credit allows)
/// are then counted twice, the count the receiver sends with its next credit is too high, the
/// broker sends more than fe2o3 allows, and fe2o3 fails the link ("more message transfers
/// than currently allowed"; docs/upstream/fe2o3-amqp-receiver-credit.md). Without the field,
/// fe2o3 keeps its own count, which the transfers it receives keep right: each link of ours
/// only receives, and the count starts from the broker's `initial-delivery-count`.
fn flow_without_delivery_count(frame: &[u8]) -> Option<Vec<u8>> {
    let doff = usize::from(*frame.get(4)?) * 4;
    if *frame.get(5)? != 0 || doff < FRAME_HEAD || doff >= frame.len() {
        return None;
    }
    let body = &frame[doff..];
    if *body.first()? != 0x00 {
        return None;
    }
    let (code, mut pos) = match *body.get(1)? {
        0x53 => (u64::from(*body.get(2)?), 3),
        0x80 => (be(body.get(2..10)?), 10),
        0xa3 => {
            let len = usize::from(*body.get(2)?);
            let name = body.get(3..3 + len)?;
            (u64::from(name == FLOW_NAME) * FLOW_CODE, 3 + len)
        }
        _ => return None,
    };
    if code != FLOW_CODE {
        return None;
    }
    let list_at = pos;
    let (count, wide) = match *body.get(pos)? {
        0xc0 => {
            pos += 3;
            (usize::from(*body.get(list_at + 2)?), false)
        }
        0xd0 => {
            pos += 9;
            (
                usize::try_from(be(body.get(list_at + 5..list_at + 9)?)).ok()?,
                true,
            )
        }
        _ => return None,
    };
    if count <= FLOW_DELIVERY_COUNT {
        return None;
    }
    for _ in 0..FLOW_DELIVERY_COUNT {
        pos = skip_value(body, pos)?;
    }
    let (value, end) = read_uint(body, pos)?;
    value?;
    let removed = end - pos - 1;
    let mut out = Vec::with_capacity(frame.len());
    out.extend_from_slice(&frame[..doff]);
    out.extend_from_slice(&body[..pos]);
    out.push(0x40);
    out.extend_from_slice(body.get(end..)?);
    // The list's size, then the frame's, shrink by what was removed.
    let size_at = doff + list_at + 1;
    if wide {
        let size = u32::try_from(be(out.get(size_at..size_at + 4)?)).ok()?;
        let size = size.checked_sub(u32::try_from(removed).ok()?)?;
        out[size_at..size_at + 4].copy_from_slice(&size.to_be_bytes());
    } else {
        let size = out.get(size_at)?.checked_sub(u8::try_from(removed).ok()?)?;
        out[size_at] = size;
    }
    let frame_size = u32::try_from(out.len()).ok()?;
    out[..4].copy_from_slice(&frame_size.to_be_bytes());
    Some(out)
}

/// What the reason in [`Cuts`] says.
fn reason(stop: &Stop) -> String {
    match stop {
        Stop::TooDeep => format!(
            "a value nested deeper than {MAX_NESTING} levels was cut on receipt (nesting guard)"
        ),
        Stop::Malformed(what) => format!(
            "the message was cut on receipt where its encoding cannot be followed ({what}; \
             nesting guard)"
        ),
        Stop::Split => "the message was cut on receipt at an array of described or compound \
                        values that fe2o3 cannot decode, whose head was split over two transfer \
                        frames, so it could not be passed on as a binary (nesting guard)"
            .to_owned(),
    }
}

/// The fields of a `transfer` the guard needs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Transfer {
    handle: u32,
    delivery_id: Option<u32>,
    more: bool,
    aborted: bool,
    /// Where the payload starts in the frame body.
    payload_start: usize,
}

impl Transfer {
    /// The performative at the start of `body`, if it is a `transfer` the guard can read
    /// (anything else is passed on as it is).
    fn parse(body: &[u8]) -> Option<Self> {
        if *body.first()? != 0x00 {
            return None;
        }
        let is_transfer = match *body.get(1)? {
            0x53 => (u64::from(*body.get(2)?), 3),
            0x80 => (be(body.get(2..10)?), 10),
            0xa3 => {
                let len = usize::from(*body.get(2)?);
                let name = body.get(3..3 + len)?;
                (u64::from(name == TRANSFER_NAME) * TRANSFER_CODE, 3 + len)
            }
            0xb3 => {
                let len = usize::try_from(be(body.get(2..6)?)).ok()?;
                let name = body.get(6..6usize.checked_add(len)?)?;
                (u64::from(name == TRANSFER_NAME) * TRANSFER_CODE, 6 + len)
            }
            _ => return None,
        };
        let (code, mut pos) = is_transfer;
        if code != TRANSFER_CODE {
            return None;
        }
        let (count, end) = match *body.get(pos)? {
            0x45 => (0, pos + 1),
            0xc0 => {
                let size = usize::from(*body.get(pos + 1)?);
                let count = usize::from(*body.get(pos + 2)?);
                pos += 3;
                (count, pos - 1 + size)
            }
            0xd0 => {
                let size = usize::try_from(be(body.get(pos + 1..pos + 5)?)).ok()?;
                let count = usize::try_from(be(body.get(pos + 5..pos + 9)?)).ok()?;
                pos += 9;
                (count, (pos - 4).checked_add(size)?)
            }
            _ => return None,
        };
        if end > body.len() {
            return None;
        }
        let fields = &body[..end];
        let mut t = Transfer {
            handle: 0,
            delivery_id: None,
            more: false,
            aborted: false,
            payload_start: end,
        };
        let mut handle = None;
        for field in 0..count.min(10) {
            match field {
                0 => (handle, pos) = read_uint(fields, pos)?,
                1 => (t.delivery_id, pos) = read_uint(fields, pos)?,
                5 => (t.more, pos) = read_bool(fields, pos)?,
                9 => (t.aborted, pos) = read_bool(fields, pos)?,
                _ => pos = skip_value(fields, pos)?,
            }
        }
        t.handle = handle?;
        Some(t)
    }
}

fn be(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0, |n, &b| (n << 8) | u64::from(b))
}

/// A `uint` (or null) at `pos`, and where it ends.
fn read_uint(buf: &[u8], pos: usize) -> Option<(Option<u32>, usize)> {
    match *buf.get(pos)? {
        0x40 => Some((None, pos + 1)),
        0x43 => Some((Some(0), pos + 1)),
        0x52 => Some((Some(u32::from(*buf.get(pos + 1)?)), pos + 2)),
        0x70 => {
            let b = buf.get(pos + 1..pos + 5)?;
            Some((Some(u32::from_be_bytes([b[0], b[1], b[2], b[3]])), pos + 5))
        }
        _ => None,
    }
}

/// A `boolean` (null is false) at `pos`, and where it ends.
fn read_bool(buf: &[u8], pos: usize) -> Option<(bool, usize)> {
    match *buf.get(pos)? {
        0x40 | 0x42 => Some((false, pos + 1)),
        0x41 => Some((true, pos + 1)),
        0x56 => Some((*buf.get(pos + 1)? != 0, pos + 2)),
        _ => None,
    }
}

/// Where the value at `pos` ends, without recursion: a compound is passed by its size, a
/// described value by its descriptor and value (counted, not recursed into).
fn skip_value(buf: &[u8], mut pos: usize) -> Option<usize> {
    let mut values = 1usize;
    while values > 0 {
        values -= 1;
        let code = *buf.get(pos)?;
        pos += 1;
        let len = match code {
            0x00 => {
                values += 2;
                0
            }
            0x40..=0x45 => 0,
            0x50..=0x56 => 1,
            0x60 | 0x61 => 2,
            0x70..=0x74 => 4,
            0x80..=0x84 => 8,
            0x94 | 0x98 => 16,
            0xa0 | 0xa1 | 0xa3 | 0xc0 | 0xc1 | 0xe0 => 1 + usize::from(*buf.get(pos)?),
            0xb0 | 0xb1 | 0xb3 | 0xd0 | 0xd1 | 0xf0 => {
                4usize.checked_add(usize::try_from(be(buf.get(pos..pos + 4)?)).ok()?)?
            }
            _ => return None,
        };
        pos = pos.checked_add(len)?;
        if pos > buf.len() {
            return None;
        }
    }
    Some(pos)
}

/// A socket whose reads go through the nesting guard; writes go through untouched. Give it to
/// fe2o3's `ConnectionBuilder::open_with_stream`, and keep a clone of its [`Cuts`] to learn why
/// a delivery failed to decode.
pub struct GuardedStream<S> {
    inner: S,
    guard: FrameGuard,
    scratch: Box<[u8]>,
}

/// What one read from the socket takes at most, when the guard looks at the bytes.
const SCRATCH: usize = 16 * 1024;

impl<S> GuardedStream<S> {
    /// Reads `inner` through the guard, which records the deliveries it cuts in `cuts`.
    pub fn new(inner: S, cuts: Cuts) -> Self {
        Self {
            inner,
            guard: frame_guard(cuts),
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
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        loop {
            if buf.remaining() == 0 {
                return Poll::Ready(Ok(()));
            }
            let pending = this.guard.pending();
            if !pending.is_empty() {
                let n = pending.len().min(buf.remaining());
                buf.put_slice(&pending[..n]);
                this.guard.consume(n);
                return Poll::Ready(Ok(()));
            }
            // Inside a frame passed as it is: straight into fe2o3's buffer.
            let direct = this.guard.direct();
            if direct > 0 {
                let n = direct.min(buf.remaining());
                let mut part = ReadBuf::new(buf.initialize_unfilled_to(n));
                ready!(Pin::new(&mut this.inner).poll_read(cx, &mut part))?;
                let read = part.filled().len();
                buf.advance(read);
                this.guard.passed_directly(read);
                return Poll::Ready(Ok(()));
            }
            let mut part = ReadBuf::new(&mut this.scratch);
            ready!(Pin::new(&mut this.inner).poll_read(cx, &mut part))?;
            let read = part.filled().len();
            if read == 0 {
                // End of stream; a frame cut short by it is fe2o3's to report.
                return Poll::Ready(Ok(()));
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

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_shutdown(cx)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().inner).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }
}

#[cfg(test)]
mod tests;
