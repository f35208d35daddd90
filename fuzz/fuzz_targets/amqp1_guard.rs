//! The AMQP 1.0 nesting guard (`crates/amqp1/src/guard.rs`): every byte the broker sends goes
//! through it before fe2o3-amqp decodes it, and transfer payloads are a publisher's.
//!
//! Input: byte 0 picks the socket read size, byte 1 whether the rest is wrapped in `transfer`
//! frames (odd) or fed raw (even). Wrapped: the rest is split into up to 4 frames of one
//! delivery (split points from bytes 2 and 3), so nesting crosses frame boundaries.
//!
//! Checked, beyond "no panic" and "no hang":
//! - the output does not depend on how the socket splits the stream;
//! - the output is never longer than the input;
//! - wrapped mode: every delivery in the output decodes (or fails to) with fe2o3's own decoder
//!   on this thread, so a nesting that got past the guard overflows the stack and is reported
//!   as a crash; a delivery the guard cut has its reason in `Cuts`. Arrays
//!   fe2o3 cannot read (described, map, list or array elements; empty; more zero-width
//!   elements than bytes) come out as binaries of the same size, so the output is exactly as
//!   long as the input unless a delivery was cut.
#![no_main]

use std::pin::Pin;
use std::task::{Context, Poll};

use fe2o3_amqp_types::messaging::message::DecodeIntoMessage;
use fe2o3_amqp_types::messaging::Body;
use fe2o3_amqp_types::primitives::Value;
use libfuzzer_sys::fuzz_target;
use redeliver_amqp1::guard::{Cuts, GuardedStream};
use tokio::io::{AsyncRead, ReadBuf};

const CHUNKS: [usize; 8] = [1, 2, 3, 7, 8, 64, 4096, usize::MAX];

struct Chunked<'a> {
    data: &'a [u8],
    chunk: usize,
}

impl AsyncRead for Chunked<'_> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        _cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        let n = self.chunk.min(buf.remaining()).min(self.data.len());
        buf.put_slice(&self.data[..n]);
        self.data = &self.data[n..];
        Poll::Ready(Ok(()))
    }
}

fn guard(input: &[u8], chunk: usize, cuts: &Cuts) -> Vec<u8> {
    let mut s = GuardedStream::new(Chunked { data: input, chunk }, cuts.clone());
    let waker = futures::task::noop_waker();
    let mut cx = Context::from_waker(&waker);
    let mut out = Vec::new();
    let mut buf = vec![0u8; 1000];
    loop {
        let mut rb = ReadBuf::new(&mut buf);
        match Pin::new(&mut s).poll_read(&mut cx, &mut rb) {
            Poll::Ready(Ok(())) if rb.filled().is_empty() => return out,
            Poll::Ready(Ok(())) => out.extend_from_slice(rb.filled()),
            other => panic!("{other:?}"),
        }
    }
}

/// A transfer frame on channel 0, handle 0.
fn transfer(delivery_id: Option<u32>, more: bool, payload: &[u8]) -> Vec<u8> {
    let mut fields = vec![0x43];
    match delivery_id {
        Some(id) => {
            fields.push(0x70);
            fields.extend_from_slice(&id.to_be_bytes());
            fields.extend_from_slice(&[0xa0, 1, id as u8]);
        }
        None => fields.extend_from_slice(&[0x40, 0x40]),
    }
    fields.extend_from_slice(&[0x43, 0x42, if more { 0x41 } else { 0x42 }]);
    let mut body = vec![0x00, 0x53, 0x14, 0xc0, (fields.len() + 1) as u8, 6];
    body.extend_from_slice(&fields);
    body.extend_from_slice(payload);
    let mut f = ((body.len() + 8) as u32).to_be_bytes().to_vec();
    f.extend_from_slice(&[2, 0, 0, 0]);
    f.extend_from_slice(&body);
    f
}

/// The transfer payloads in a stream the fuzz target wrote (frames only, type 0).
fn payloads(stream: &[u8]) -> Vec<u8> {
    let mut rest = stream;
    let mut out = Vec::new();
    while rest.len() >= 8 {
        let size = u32::from_be_bytes([rest[0], rest[1], rest[2], rest[3]]) as usize;
        let (f, r) = rest.split_at(size.min(rest.len()));
        rest = r;
        // The performative is 6 + fields bytes: its list8 size says how many.
        let end = 8 + 5 + f[12] as usize;
        out.extend_from_slice(&f[end.min(f.len())..]);
    }
    out
}

fuzz_target!(|data: &[u8]| {
    let [read, mode, a, b, rest @ ..] = data else {
        return;
    };
    let chunk = CHUNKS[usize::from(*read) % CHUNKS.len()];
    let input = if mode & 1 == 0 {
        data[1..].to_vec()
    } else {
        let len = rest.len();
        let mut cuts = [usize::from(*a) * len / 256, usize::from(*b) * len / 256];
        cuts.sort_unstable();
        let parts = [&rest[..cuts[0]], &rest[cuts[0]..cuts[1]], &rest[cuts[1]..]];
        let mut input = Vec::new();
        for (i, part) in parts.iter().enumerate() {
            input.extend(transfer((i == 0).then_some(7), i < 2, part));
        }
        input
    };
    let cuts = Cuts::new();
    let out = guard(&input, chunk, &cuts);
    assert_eq!(
        out,
        guard(&input, usize::MAX, &Cuts::new()),
        "chunk {chunk}"
    );
    assert!(out.len() <= input.len(), "the output grew");
    if mode & 1 == 1 {
        let payload = payloads(&out);
        let cut = cuts.take(7);
        if cut.is_none() {
            // Nothing cut: arrays turned into binaries changed one byte each, no length.
            assert_eq!(out.len(), input.len(), "a length changed without a cut");
        }
        // On this thread: nesting that got through overflows the stack, a crash.
        // serde_amqp 0.18 does unchecked arithmetic on sizes and counts (a map's count minus 2
        // per entry, a list header's count added to a field count): on malformed input a
        // build with overflow checks panics there (an unwinding panic, which the worker's link
        // task catches: the delivery ends the link, never the process), a release build wraps
        // and the decode fails. The guard removes what it can at the head; what is left is
        // docs/upstream/serde_amqp-described-arrays.md's second part. A stack overflow, what
        // this target is for, aborts and is still reported.
        // libFuzzer's panic hook aborts even inside catch_unwind: a quiet one meanwhile.
        let hook = std::panic::take_hook();
        std::panic::set_hook(Box::new(|_| {}));
        let decoded = std::panic::catch_unwind(|| {
            <Body<Value> as DecodeIntoMessage>::decode_message_from_reader(
                serde_amqp::read::SliceReader::new(&payload),
            )
        });
        std::panic::set_hook(hook);
        // A cut delivery may still decode (a cut right after a complete section): the
        // consumer takes every delivery found in `Cuts` as undecodable, decoded or not, so
        // what matters here is that the cut was recorded, which `cut` is.
        let _ = (decoded, cut);
    }
});
