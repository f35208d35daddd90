//! The framing under both of redeliver's frame guards: a filter that reads a stream of frames as
//! it arrives, in pieces of any size, holds whole the frames its rules want to look at, and
//! passes every other byte on as it is, straight from the socket into the parser's buffer
//! where it can (see [`FrameFilter::direct`]).
//!
//! AMQP 0-9-1 (the guard under lapin, in this crate) and AMQP 1.0 (the guard under fe2o3, in
//! `redeliver-amqp1`) differ only in their [`FrameRules`]: how long a frame's head is, what its
//! length is, which frames are held, and what becomes of a held frame. The state machine that
//! follows frame boundaries across reads, which is where a mistake lets hostile bytes past
//! unread, is this one, fuzzed through both guards.
//!
//! ```
//! use redeliver_amqp::framing::{FrameFilter, FrameRules, Route};
//!
//! /// Frames of a 1-byte length and that many bytes; those of length 2 are upper-cased.
//! struct Shout;
//!
//! impl FrameRules for Shout {
//!     const HEAD: usize = 1;
//!     fn route(&mut self, head: &[u8]) -> Route {
//!         match head[0] {
//!             2 => Route::Hold(2),
//!             n => Route::Pass(usize::from(n)),
//!         }
//!     }
//!     fn release(&mut self, frame: &mut [u8], out: &mut Vec<u8>) {
//!         frame.make_ascii_uppercase();
//!         out.extend_from_slice(frame);
//!     }
//! }
//!
//! let mut filter = FrameFilter::new(Shout);
//! // Frame boundaries fall anywhere in what is read.
//! filter.feed(b"\x03abc\x02");
//! filter.feed(b"de\x01f");
//! assert_eq!(filter.pending(), b"\x03abc\x02DE\x01f");
//! ```

use std::fmt;

/// How one protocol's frames are read: what a [`FrameFilter`] asks of them.
pub trait FrameRules {
    /// The length of a frame's head: the bytes from which [`Self::route`] learns its length.
    const HEAD: usize;

    /// Whether a stream whose next frame begins with the byte `first` carries frames at all.
    /// `false` makes the filter [`Route::Transparent`] at once, without waiting for a whole
    /// head (AMQP 0-9-1: a broker refusing the client's protocol answers with its own
    /// protocol header, 8 bytes, and closes). Always `true` unless a protocol says otherwise.
    fn frames_start_with(&self, first: u8) -> bool {
        let _ = first;
        true
    }

    /// What to do with the frame whose head (`HEAD` bytes) this is.
    fn route(&mut self, head: &[u8]) -> Route;

    /// A frame the rules asked to hold is complete, head included: append it, or what replaces
    /// it, to `out`. `frame` may be changed in place.
    fn release(&mut self, frame: &mut [u8], out: &mut Vec<u8>);
}

/// Where a frame goes, decided from its head.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Route {
    /// Hold it, and the given number of bytes after its head, to hand it to
    /// [`FrameRules::release`] whole.
    Hold(usize),
    /// Pass its head and the given number of bytes after it on as they are.
    Pass(usize),
    /// The stream is not (or no longer) one of frames: the head and everything after it pass
    /// on as they are, for the parser to report.
    Transparent,
}

/// What the filter is doing with the bytes coming in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    /// Reading a frame's head into `held`.
    Head,
    /// Holding a frame of this many bytes in all, head included.
    Hold(usize),
    /// Passing this many more bytes through as they are.
    Pass(usize),
    /// Everything passes through.
    Transparent,
}

/// A byte-level filter of a frame stream: bytes in through [`Self::feed`] (or straight to the
/// parser where [`Self::direct`] allows), frames out through [`Self::pending`].
pub struct FrameFilter<R> {
    rules: R,
    state: State,
    /// The head being read, then the frame being held (head first).
    held: Vec<u8>,
    out: Vec<u8>,
    out_pos: usize,
}

impl<R: fmt::Debug> fmt::Debug for FrameFilter<R> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("FrameFilter")
            .field("state", &self.state)
            .field("rules", &self.rules)
            .finish_non_exhaustive()
    }
}

impl<R: FrameRules> FrameFilter<R> {
    /// A filter at the start of a stream.
    pub fn new(rules: R) -> Self {
        Self {
            rules,
            state: State::Head,
            held: Vec::new(),
            out: Vec::new(),
            out_pos: 0,
        }
    }

    /// The rules, and what they learnt from the stream so far.
    pub fn rules(&self) -> &R {
        &self.rules
    }

    /// Bytes ready for the parser.
    pub fn pending(&self) -> &[u8] {
        &self.out[self.out_pos..]
    }

    /// `n` bytes of [`Self::pending`] were taken (more than it holds counts as all of them).
    pub fn consume(&mut self, n: usize) {
        self.out_pos += n.min(self.out.len() - self.out_pos);
        if self.out_pos >= self.out.len() {
            self.out.clear();
            self.out_pos = 0;
        }
    }

    /// How many of the bytes coming next may go to the parser as they are, without passing
    /// through the filter: nothing is pending, and they are inside a frame that is passed on.
    pub fn direct(&self) -> usize {
        if !self.pending().is_empty() {
            return 0;
        }
        match self.state {
            State::Pass(n) => n,
            State::Transparent => usize::MAX,
            State::Head | State::Hold(_) => 0,
        }
    }

    /// `n` bytes (at most [`Self::direct`]) went to the parser directly.
    pub fn passed_directly(&mut self, n: usize) {
        if let State::Pass(left) = self.state {
            let left = left.saturating_sub(n);
            self.state = if left == 0 {
                State::Head
            } else {
                State::Pass(left)
            };
        }
    }

    /// Takes bytes read from the stream; what the parser may see goes to [`Self::pending`].
    pub fn feed(&mut self, mut input: &[u8]) {
        while !input.is_empty() {
            match self.state {
                State::Transparent => {
                    self.out.extend_from_slice(input);
                    return;
                }
                State::Pass(left) => {
                    let n = left.min(input.len());
                    self.out.extend_from_slice(&input[..n]);
                    input = &input[n..];
                    self.state = if left == n {
                        State::Head
                    } else {
                        State::Pass(left - n)
                    };
                }
                State::Head => {
                    let n = (R::HEAD - self.held.len()).min(input.len());
                    self.held.extend_from_slice(&input[..n]);
                    input = &input[n..];
                    if !self.rules.frames_start_with(self.held[0]) {
                        self.pass_on(State::Transparent);
                        continue;
                    }
                    if self.held.len() < R::HEAD {
                        continue;
                    }
                    match self.rules.route(&self.held) {
                        Route::Hold(rest) => {
                            self.state = State::Hold(R::HEAD.saturating_add(rest));
                            self.release_if_whole();
                        }
                        Route::Pass(0) => self.pass_on(State::Head),
                        Route::Pass(rest) => self.pass_on(State::Pass(rest)),
                        Route::Transparent => self.pass_on(State::Transparent),
                    }
                }
                State::Hold(total) => {
                    let n = (total - self.held.len()).min(input.len());
                    self.held.extend_from_slice(&input[..n]);
                    input = &input[n..];
                    self.release_if_whole();
                }
            }
        }
    }

    /// A held frame that is complete goes to the rules; the filter reads the next head.
    fn release_if_whole(&mut self) {
        if let State::Hold(total) = self.state {
            if self.held.len() == total {
                let mut frame = std::mem::take(&mut self.held);
                self.rules.release(&mut frame, &mut self.out);
                // The buffer is kept for the next frame.
                frame.clear();
                self.held = frame;
                self.state = State::Head;
            }
        }
    }

    /// What the parser receives when `input` arrives `chunk` bytes (at least 1) at a time, read
    /// the way the guarded streams read: inside a frame passed as it is, bytes go straight
    /// through ([`Self::direct`]); everything else is fed to the filter. For tests and fuzzing:
    /// the output must not depend on `chunk`.
    pub fn read_through(&mut self, input: &[u8], chunk: usize) -> Vec<u8> {
        let mut out = Vec::new();
        let mut rest = input;
        while !rest.is_empty() {
            let n = chunk.max(1).min(rest.len());
            let direct = self.direct();
            if direct > 0 {
                let n = n.min(direct);
                out.extend_from_slice(&rest[..n]);
                self.passed_directly(n);
                rest = &rest[n..];
            } else {
                self.feed(&rest[..n]);
                rest = &rest[n..];
            }
            out.extend_from_slice(self.pending());
            let n = self.pending().len();
            self.consume(n);
        }
        out
    }

    /// What is held so far goes out as it is, and the filter goes on in `next`.
    fn pass_on(&mut self, next: State) {
        self.out.extend_from_slice(&self.held);
        self.held.clear();
        self.state = next;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// Frames of a 2-byte head (kind, length) and that many bytes: kind 1 is held and
    /// reversed, kind 0 passed, kind 9 ends the framing, and a stream starting `A` is none.
    #[derive(Debug, Default)]
    struct Toy {
        released: usize,
    }

    impl FrameRules for Toy {
        const HEAD: usize = 2;
        fn frames_start_with(&self, first: u8) -> bool {
            first != b'A'
        }
        fn route(&mut self, head: &[u8]) -> Route {
            match head[0] {
                1 => Route::Hold(usize::from(head[1])),
                9 => Route::Transparent,
                _ => Route::Pass(usize::from(head[1])),
            }
        }
        fn release(&mut self, frame: &mut [u8], out: &mut Vec<u8>) {
            self.released += 1;
            frame[2..].reverse();
            out.extend_from_slice(frame);
        }
    }

    fn through(input: &[u8], chunk: usize) -> (Vec<u8>, usize) {
        let mut filter = FrameFilter::new(Toy::default());
        let out = filter.read_through(input, chunk);
        (out, filter.rules().released)
    }

    #[test]
    fn held_frames_are_released_whole_and_the_rest_passes() {
        let input = b"\x00\x02ab\x01\x03xyz\x00\x00\x01\x00\x09\x01\x01\x02q";
        let (out, released) = through(input, usize::MAX);
        assert_eq!(
            out,
            b"\x00\x02ab\x01\x03zyx\x00\x00\x01\x00\x09\x01\x01\x02q"
        );
        // The empty held frame too; after kind 9 nothing is read as a frame.
        assert_eq!(released, 2);
    }

    #[test]
    fn a_stream_that_is_not_frames_passes_from_its_first_byte() {
        let (out, released) = through(b"AMQP\x00\x00\x09\x01\x01\x02ab", 1);
        assert_eq!(out, b"AMQP\x00\x00\x09\x01\x01\x02ab");
        assert_eq!(released, 0);
    }

    /// A stream of whole toy frames (kinds 0 and 1) from arbitrary lengths and bytes.
    fn frames() -> impl Strategy<Value = Vec<u8>> {
        prop::collection::vec(
            (any::<bool>(), prop::collection::vec(any::<u8>(), 0..40)),
            0..20,
        )
        .prop_map(|frames| {
            let mut out = Vec::new();
            for (hold, body) in frames {
                out.push(u8::from(hold));
                out.push(u8::try_from(body.len()).unwrap_or(0));
                out.extend_from_slice(&body);
            }
            out
        })
    }

    proptest! {
        #[test]
        fn how_the_bytes_arrive_does_not_change_the_output(
            input in frames(),
            chunk in 1usize..50,
            tail in prop::collection::vec(any::<u8>(), 0..10),
        ) {
            // A cut-off frame at the end as well: what arrived of it is held or passed.
            let mut input = input;
            input.extend_from_slice(&tail);
            let whole = through(&input, usize::MAX);
            prop_assert_eq!(through(&input, chunk), whole);
        }
    }
}
