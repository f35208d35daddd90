//! The incremental scanner of the AMQP 1.0 type system (part 1 of the specification): it follows
//! a delivery's payload as it arrives, frame after frame, and knows at every byte how deep the
//! decoder will be there. No recursion: the open compounds are a stack of at most
//! [`MAX_NESTING`] + 1 entries, and a token cut by a frame boundary waits in a 16-byte carry.
//!
//! What a level is: every list, map and array, and every described value (`0x00` descriptor
//! value), since serde_amqp recurses into each of them. A compound is followed by its `count`
//! (as serde_amqp reads it) and must end exactly where its `size` says (as a size-based reader
//! would): an encoding where the two disagree is malformed, so the depth seen here is the depth
//! any reader of these bytes reaches.
//!
//! Arrays serde_amqp 0.18.0 cannot read (see [`needs_binary`]) are turned into binaries of the
//! same size, in place: the array's constructor `0xe0` becomes `0xa0` (vbin8), `0xf0` becomes
//! `0xb0` (vbin32), so its size field becomes the binary's length, which covers exactly the
//! count, the element constructor and the elements. The scanner then passes over those bytes as
//! data: they are never decoded, so they are no level, and neither is the array itself. The
//! byte to change may lie in an earlier frame, already passed on: then the delivery is cut
//! ([`Stop::Split`]).

use super::MAX_NESTING;

/// Why the scan stopped: where it stopped is where the delivery is cut.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Stop {
    /// A value would open a level past [`MAX_NESTING`].
    TooDeep,
    /// An encoding the scanner cannot follow: what is wrong with it.
    Malformed(&'static str),
    /// An array to turn into a binary whose constructor was in an earlier frame, already passed
    /// on unchanged: the decoder would refuse it (or misread it), and it can no longer be fixed.
    Split,
}

/// What each element of an array is (an array shares one constructor among its elements).
/// Only primitive elements: an array of anything else is turned into a binary.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Width {
    /// This many bytes each.
    Fixed(u64),
    /// A length of this many bytes (1 or 4), then that many bytes.
    Var(u8),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    /// A list, a map (keys and values alike), or a described value (descriptor, then value).
    Seq,
    /// An array before its element constructor; `at` is where its own constructor is in the
    /// payload (the byte to change if it becomes a binary).
    ArrayCtor { at: u64 },
    /// An array's elements.
    Array { width: Width },
}

/// An open compound.
#[derive(Debug, Clone, Copy)]
struct Open {
    /// Where it ends, for a size-prefixed compound.
    end: Option<u64>,
    /// The innermost end around it (its own or an ancestor's).
    limit: Option<u64>,
    /// Elements not yet started.
    left: u64,
    /// Its level: 1 for a value at the top of the payload.
    depth: usize,
    kind: Kind,
}

/// The longest token read whole: a list32's, map32's or array32's constructor, size and count
/// (9 bytes).
const CARRY: usize = 16;

/// What an array constructor becomes to be read as a binary of the same size: `0xe0` (array8:
/// size u8, count u8, element constructor, elements) `0xa0` (vbin8: length u8, that many
/// bytes), `0xf0` (array32) `0xb0` (vbin32). Both are `- 0x40`.
const TO_BINARY: u8 = 0x40;

/// One delivery's scan state.
#[derive(Debug, Clone)]
pub(crate) struct Scanner {
    /// Bytes of the payload seen so far.
    pos: u64,
    stack: Vec<Open>,
    /// Data bytes to pass over (a string's, a fixed-width value's, an array's fixed elements).
    skip: u64,
    /// Whether the end of `skip` ends an element.
    skip_ends_element: bool,
    carry: [u8; CARRY],
    carry_len: usize,
    /// Payload bytes fed before the current input (where its first byte is in the payload).
    fed: u64,
    /// An array constructor to turn into a binary's, by its place in the payload: set by a
    /// token, applied by [`Scanner::feed`], which holds the input.
    to_binary: Option<u64>,
    /// How many arrays were turned into binaries.
    rewritten: u64,
}

impl Default for Scanner {
    fn default() -> Self {
        Self {
            pos: 0,
            stack: Vec::new(),
            skip: 0,
            skip_ends_element: false,
            carry: [0; CARRY],
            carry_len: 0,
            fed: 0,
            to_binary: None,
            rewritten: 0,
        }
    }
}

/// What a token does once read whole.
enum Step {
    /// More bytes are needed.
    Need,
    /// This many bytes of the window were used.
    Took(usize),
}

/// The width of a fixed-width constructor's data, `None` for any other.
fn fixed_width(code: u8) -> Option<u64> {
    Some(match code {
        // null, true, false, uint0, ulong0, list0
        0x40..=0x45 => 0,
        // ubyte, byte, smalluint, smallulong, smallint, smalllong, boolean
        0x50..=0x56 => 1,
        // ushort, short
        0x60 | 0x61 => 2,
        // uint, int, float, char, decimal32
        0x70..=0x74 => 4,
        // ulong, long, double, timestamp, decimal64
        0x80..=0x84 => 8,
        // decimal128, uuid
        0x94 | 0x98 => 16,
        _ => return None,
    })
}

/// The element kind a primitive array constructor gives (`None` for any other).
fn width_of(code: u8) -> Option<Width> {
    if let Some(w) = fixed_width(code) {
        return Some(Width::Fixed(w));
    }
    Some(match code {
        0xa0 | 0xa1 | 0xa3 => Width::Var(1),
        0xb0 | 0xb1 | 0xb3 => Width::Var(4),
        _ => return None,
    })
}

/// Whether an array with this element constructor is one serde_amqp 0.18.0 cannot read, so it
/// is turned into a binary: described elements (`0x00`: refused whatever the count; RabbitMQ's
/// `x-opt-deaths`), maps (refused whatever the count, and a debug build can panic on a size
/// underflow), lists and arrays (read right only when there is a single element: the decoder
/// keeps one "element constructor" for all the arrays it is inside, which the first element's
/// own contents overwrite). List0 elements (`0x45`, no contents) are read right and are kept.
/// Two more kinds are decided by the array's head, before this: an empty array, and one with
/// more (zero-width) elements than bytes.
pub(crate) fn needs_binary(element_constructor: u8) -> bool {
    matches!(
        element_constructor,
        0x00 | 0xc0 | 0xc1 | 0xd0 | 0xd1 | 0xe0 | 0xf0
    )
}

fn be(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0, |n, &b| (n << 8) | u64::from(b))
}

impl Scanner {
    /// How many arrays of this delivery were turned into binaries so far.
    pub(crate) fn rewritten(&self) -> u64 {
        self.rewritten
    }

    /// Scans the next bytes of the payload, turning the arrays the decoder cannot read into
    /// binaries in place (one byte each; no length changes). On a stop, the offset in `input`
    /// where the cut begins: the start of the offending token (0 when it began in an earlier
    /// frame), or the byte after the element that broke its compound's size.
    pub(crate) fn feed(&mut self, input: &mut [u8]) -> Result<(), (usize, Stop)> {
        let base = self.fed;
        self.fed += input.len() as u64;
        let mut i = 0;
        while i < input.len() {
            if self.skip > 0 {
                let n = usize::try_from(self.skip)
                    .unwrap_or(usize::MAX)
                    .min(input.len() - i);
                i += n;
                self.pos += n as u64;
                self.skip -= n as u64;
                if self.skip == 0 && self.skip_ends_element {
                    self.skip_ends_element = false;
                    self.element_done().map_err(|s| (i, s))?;
                }
                continue;
            }
            let had = self.carry_len;
            let take = (CARRY - had).min(input.len() - i);
            let mut window = [0u8; CARRY];
            window[..had].copy_from_slice(&self.carry[..had]);
            window[had..had + take].copy_from_slice(&input[i..i + take]);
            let window = &window[..had + take];
            let step = self.token(window).map_err(|s| (i, s))?;
            if let Some(at) = self.to_binary.take() {
                // In this input, or passed on already with an earlier frame.
                let here = at
                    .checked_sub(base)
                    .and_then(|at| usize::try_from(at).ok())
                    .and_then(|at| input.get_mut(at));
                match here {
                    Some(code) => {
                        *code -= TO_BINARY;
                        self.rewritten += 1;
                    }
                    None => return Err((i, Stop::Split)),
                }
            }
            match step {
                Step::Need => {
                    // Only when the window holds everything left: keep it for the next frame.
                    self.carry[..window.len()].copy_from_slice(window);
                    self.carry_len = window.len();
                    return Ok(());
                }
                Step::Took(n) => {
                    self.carry_len = 0;
                    i += n.saturating_sub(had);
                }
            }
        }
        Ok(())
    }

    /// Reads one token at the start of `w` and acts on it.
    fn token(&mut self, w: &[u8]) -> Result<Step, Stop> {
        let top = self.stack.last().copied();
        match top.map(|o| o.kind) {
            None | Some(Kind::Seq) => self.value(w),
            Some(Kind::ArrayCtor { at }) => self.array_ctor(w, at),
            Some(Kind::Array { width }) => self.array_element(w, width),
        }
    }

    fn parent_depth(&self) -> usize {
        self.stack.last().map_or(0, |o| o.depth)
    }

    fn parent_limit(&self) -> Option<u64> {
        self.stack.last().and_then(|o| o.limit)
    }

    /// An element starts: it must start inside the compound around it.
    fn room(&self) -> Result<(), Stop> {
        match self.parent_limit() {
            Some(limit) if self.pos >= limit => Err(Stop::Malformed(
                "a compound with more elements than its size holds",
            )),
            _ => Ok(()),
        }
    }

    /// Marks the start of an element of the compound on top.
    fn start_element(&mut self) {
        if let Some(top) = self.stack.last_mut() {
            top.left = top.left.saturating_sub(1);
        }
    }

    /// A constructor-led value: at the top of the payload, in a list or map, or a described
    /// value's descriptor or value.
    fn value(&mut self, w: &[u8]) -> Result<Step, Stop> {
        let Some(&code) = w.first() else {
            return Ok(Step::Need);
        };
        self.room()?;
        let depth = self.parent_depth() + 1;
        if code == 0x00 {
            if depth > MAX_NESTING {
                return Err(Stop::TooDeep);
            }
            self.start_element();
            self.pos += 1;
            self.push(None, 2, depth, Kind::Seq)?;
            return Ok(Step::Took(1));
        }
        if let Some(width) = fixed_width(code) {
            self.start_element();
            self.pos += 1;
            self.data(width)?;
            return Ok(Step::Took(1));
        }
        let (head, wide) = match code {
            0xa0 | 0xa1 | 0xa3 => (2, false),
            0xb0 | 0xb1 | 0xb3 => (5, true),
            0xc0 | 0xc1 | 0xe0 => (3, false),
            0xd0 | 0xd1 | 0xf0 => (9, true),
            _ => return Err(Stop::Malformed("an unknown constructor")),
        };
        let Some(h) = w.get(1..head) else {
            // The head is split over two frames, and what is here goes on with this one: check
            // now what of it can be checked, since the cut mark cannot repair bytes passed on.
            // serde_amqp 0.18 subtracts a compound's own count width from its size, and 2 per
            // entry from a map's count, without checking (a panic in a debug build).
            let n = if wide { 4 } else { 1 };
            if matches!(code, 0xc0 | 0xc1 | 0xd0 | 0xd1 | 0xe0 | 0xf0) {
                if let Some(size) = w.get(1..1 + n) {
                    let inside = n as u64 + u64::from(matches!(code, 0xe0 | 0xf0));
                    if be(size) < inside {
                        return Err(Stop::Malformed("a compound smaller than its own count"));
                    }
                }
            }
            return Ok(Step::Need);
        };
        match code {
            0xa0 | 0xa1 | 0xa3 | 0xb0 | 0xb1 | 0xb3 => {
                self.start_element();
                self.pos += head as u64;
                self.data(be(h))?;
            }
            0xe0 | 0xf0 => {
                let n = if wide { 4 } else { 1 };
                let (size, count) = (be(&h[..n]), be(&h[n..]));
                if size <= n as u64 {
                    return Err(Stop::Malformed("a compound smaller than its own count"));
                }
                if count == 0 || count > size {
                    // An empty array still has an element constructor, which serde_amqp does
                    // not read (it takes it for the next value); more elements than bytes
                    // (zero-width ones: null, true, false, 0, list0) serde_amqp refuses (a
                    // bound against huge counts). Both valid: a binary instead.
                    self.to_binary = Some(self.pos);
                    self.start_element();
                    self.pos += head as u64;
                    self.data(size - n as u64)?;
                } else {
                    // Its level is checked once its element constructor says whether it stays
                    // an array.
                    let at = self.pos;
                    self.start_element();
                    self.pos += 1;
                    self.compound(h, wide, depth, Kind::ArrayCtor { at })?;
                }
            }
            _ => {
                if depth > MAX_NESTING {
                    return Err(Stop::TooDeep);
                }
                if matches!(code, 0xc1 | 0xd1) && be(&h[if wide { 4 } else { 1 }..]) % 2 == 1 {
                    // A map's count covers keys and values: never odd. serde_amqp 0.18 takes
                    // 2 from it per entry, which overflows on an odd one (a panic in a debug
                    // build, a count near 2^32 in a release one).
                    return Err(Stop::Malformed("a map with an odd count"));
                }
                self.start_element();
                self.pos += 1;
                self.compound(h, wide, depth, Kind::Seq)?;
            }
        }
        Ok(Step::Took(head))
    }

    /// Opens a size-prefixed compound whose size and count are `h`, at `self.pos` (after the
    /// constructor, if it has one).
    fn compound(&mut self, h: &[u8], wide: bool, depth: usize, kind: Kind) -> Result<(), Stop> {
        let n = if wide { 4 } else { 1 };
        let size = be(&h[..n]);
        let count = be(&h[n..2 * n]);
        // The count is inside the size, and an array's constructor too.
        let inside = n as u64 + u64::from(matches!(kind, Kind::ArrayCtor { .. }));
        if size < inside {
            return Err(Stop::Malformed("a compound smaller than its own count"));
        }
        // Every element of a list, a map or a described value takes a byte at least: more
        // elements than bytes cannot be, and serde_amqp 0.18 adds such a count to its field
        // count unchecked (a panic in a debug build). Checked at the head, before it goes on.
        if matches!(kind, Kind::Seq) && count > size - n as u64 {
            return Err(Stop::Malformed("a compound with more elements than bytes"));
        }
        let end = self.pos + n as u64 + size;
        self.pos += 2 * n as u64;
        self.push(Some(end), count, depth, kind)
    }

    fn push(&mut self, end: Option<u64>, left: u64, depth: usize, kind: Kind) -> Result<(), Stop> {
        let parent = self.parent_limit();
        if let (Some(end), Some(limit)) = (end, parent) {
            if end > limit {
                return Err(Stop::Malformed("a compound larger than the one around it"));
            }
        }
        self.stack.push(Open {
            end,
            limit: end.or(parent),
            left,
            depth,
            kind,
        });
        if left == 0 && kind == Kind::Seq {
            return self.element_done_on_top();
        }
        Ok(())
    }

    /// `n` data bytes follow, ending an element.
    fn data(&mut self, n: u64) -> Result<(), Stop> {
        if let Some(limit) = self.parent_limit() {
            if self.pos.saturating_add(n) > limit {
                return Err(Stop::Malformed(
                    "a value larger than the compound around it",
                ));
            }
        }
        if n == 0 {
            return self.element_done();
        }
        self.skip = n;
        self.skip_ends_element = true;
        Ok(())
    }

    /// The element constructor of the array on top, whose own constructor is at `at`.
    fn array_ctor(&mut self, w: &[u8], at: u64) -> Result<Step, Stop> {
        let Some(&code) = w.first() else {
            return Ok(Step::Need);
        };
        let Some(top) = self.stack.last().copied() else {
            return Err(Stop::Malformed("an array element outside an array"));
        };
        if needs_binary(code) {
            // From here to the array's end is the binary's data: never decoded, so nothing in
            // it (nor the array) is a level. A described constructor's descriptor is in it too,
            // whatever it is.
            self.to_binary = Some(at);
            self.stack.pop();
            let end = top.end.unwrap_or(self.pos);
            self.data(end.saturating_sub(self.pos))?;
            return Ok(Step::Took(0));
        }
        let Some(width) = width_of(code) else {
            return Err(Stop::Malformed("an unknown constructor"));
        };
        if top.depth > MAX_NESTING {
            return Err(Stop::TooDeep);
        }
        self.pos += 1;
        if let Some(top) = self.stack.last_mut() {
            top.kind = Kind::Array { width };
        }
        if top.left == 0 {
            self.element_done_on_top()?;
        }
        Ok(Step::Took(1))
    }

    /// The next element of the array on top (its data, without a constructor).
    fn array_element(&mut self, w: &[u8], width: Width) -> Result<Step, Stop> {
        match width {
            Width::Fixed(n) => {
                // All the rest at once: an array of a million nulls is one step.
                let left = self.stack.last().map_or(0, |o| o.left);
                if let Some(top) = self.stack.last_mut() {
                    top.left = 0;
                }
                self.data(left.saturating_mul(n))?;
                Ok(Step::Took(0))
            }
            Width::Var(n) => {
                self.room()?;
                let Some(h) = w.get(..usize::from(n)) else {
                    return Ok(Step::Need);
                };
                self.start_element();
                self.pos += u64::from(n);
                self.data(be(h))?;
                Ok(Step::Took(usize::from(n)))
            }
        }
    }

    /// An element of the compound on top ended: close every compound that is complete.
    fn element_done(&mut self) -> Result<(), Stop> {
        if self.stack.is_empty() {
            return Ok(());
        }
        self.element_done_on_top()
    }

    fn element_done_on_top(&mut self) -> Result<(), Stop> {
        while let Some(top) = self.stack.last().copied() {
            if top.limit.is_some_and(|limit| self.pos > limit) {
                return Err(Stop::Malformed(
                    "a value larger than the compound around it",
                ));
            }
            if top.left > 0 || matches!(top.kind, Kind::ArrayCtor { .. }) {
                return Ok(());
            }
            if top.end.is_some_and(|end| self.pos != end) {
                return Err(Stop::Malformed("a compound whose size and count disagree"));
            }
            self.stack.pop();
        }
        Ok(())
    }
}
