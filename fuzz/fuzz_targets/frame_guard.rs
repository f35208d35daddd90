//! The frame guard (`crates/amqp/src/frame_guard.rs`): every byte the broker sends goes
//! through it before lapin parses it, and the content headers in it are the publisher's.
//!
//! Input: byte 0 picks the mode and the socket read size, byte 1 the client's frame size.
//! Raw mode: the rest is the byte stream from the broker, anything at all. Structured mode:
//! the rest drives a generator of well-formed frames (tune, content headers encoded by lapin's
//! own protocol crate with arbitrary properties and headers nested up to 2,000 levels, bodies,
//! heartbeats), so the guard's output can be checked against what it was given.
//!
//! Checked, beyond "no panic":
//! - the output does not depend on how the socket splits the stream;
//! - frames are neither lost, merged nor reordered;
//! - every content header in the output that lapin's parser accepts, up to the first frame it
//!   refuses (a parse error closes lapin's connection), nests at most `MAX_HEADER_DEPTH` levels
//!   (parsed on this thread: a guard that let a deep table through would overflow the stack
//!   here, and the fuzzer reports that as a crash);
//! - structured mode: a header that needs no change passes byte for byte; otherwise the output
//!   parses, keeps every other property, keeps every header nested at most
//!   `MAX_HEADER_DEPTH` levels with its value, replaces each deeper one by a string, marks the
//!   message with `HEADERS_REMOVED` exactly when something was removed (a forged marker is
//!   dropped), and fits the frame size.
#![no_main]

use amq_protocol::frame::{parse_frame, AMQPFrame};
use arbitrary::Unstructured;
use lapin::types::{AMQPValue, FieldArray, FieldTable, ShortString};
use lapin::BasicProperties;
use libfuzzer_sys::fuzz_target;
use redeliver_amqp::fuzzing::guard_stream;
use redeliver_amqp::{HEADERS_REMOVED, MAX_HEADER_DEPTH};
use redeliver_fuzz::amqp::{self, depth, header_frame, lapin_reads, split_frames};

const CHUNKS: [usize; 10] = [1, 2, 3, 5, 7, 8, 13, 64, 4096, usize::MAX];
const FRAME_MAXES: [u32; 4] = [0, 4096, 131_072, 8];

/// A frame the structured mode wrote, and what the guard must do with it.
enum Sent {
    Header {
        frame: Vec<u8>,
        properties: BasicProperties,
        /// The frame size the guard knows when this frame arrives (0: none).
        frame_max: u32,
    },
    Other,
}

fuzz_target!(|data: &[u8]| {
    let [mode, fm, rest @ ..] = data else {
        return;
    };
    let chunk = CHUNKS[usize::from(*mode & 0x7f) % CHUNKS.len()];
    let client_frame_max = FRAME_MAXES[usize::from(*fm) % FRAME_MAXES.len()];
    let (input, sent) = if mode & 0x80 == 0 {
        (rest.to_vec(), Vec::new())
    } else {
        match structured(&mut Unstructured::new(rest), client_frame_max) {
            Ok(v) => v,
            Err(_) => return,
        }
    };
    let out = guard_stream(&input, chunk, client_frame_max);
    // However the socket splits the stream, lapin gets the same bytes.
    assert_eq!(
        out,
        guard_stream(&input, usize::MAX, client_frame_max),
        "chunk {chunk}"
    );

    let in_frames = split_frames(&input);
    let out_frames = split_frames(&out);
    // The broker's own protocol header (`AMQP...`) is passed through untouched, not framed.
    if !input.starts_with(b"AMQP") {
        assert_eq!(in_frames.len(), out_frames.len(), "frames lost or merged");
        for (a, b) in in_frames.iter().zip(&out_frames) {
            assert_eq!((a.0, a.1), (b.0, b.1), "frame type or channel changed");
        }
    }
    // Every header lapin parses is within the limit (it closes the connection at the first
    // frame it cannot parse, and reads nothing after it).
    for (kind, _, frame) in &lapin_reads(&out_frames) {
        if *kind == 2 {
            if let Ok((_, AMQPFrame::Header(_, h))) = parse_frame(*frame) {
                if let Some(t) = h.properties.headers() {
                    for v in t.inner().values() {
                        assert!(
                            depth(v) <= MAX_HEADER_DEPTH,
                            "a header nests {} levels",
                            depth(v)
                        );
                    }
                }
            }
        }
    }
    for (sent, (_, _, got)) in sent.iter().zip(&out_frames) {
        if let Sent::Header {
            frame,
            properties,
            frame_max,
        } = sent
        {
            check_header(frame, properties, *frame_max, got);
        }
    }
});

/// Frames from fuzz input, and what each one is.
fn structured(
    u: &mut Unstructured<'_>,
    client_frame_max: u32,
) -> arbitrary::Result<(Vec<u8>, Vec<Sent>)> {
    let mut input = Vec::new();
    let mut sent = Vec::new();
    let mut frame_max = client_frame_max;
    u.arbitrary_loop(Some(1), Some(8), |u| {
        match u.int_in_range(0u8..=4)? {
            0 => {
                let broker = *u.choose(&[0u32, 4096, 8192, 131_072, u32::MAX])?;
                let mut p = vec![0, 10, 0, 30, 0x07, 0xff];
                p.extend_from_slice(&broker.to_be_bytes());
                p.extend_from_slice(&60u16.to_be_bytes());
                input.extend_from_slice(&frame(1, 0, &p));
                frame_max = match (broker, client_frame_max) {
                    (0, c) => c,
                    (b, 0) => b,
                    (b, c) => b.min(c),
                };
                sent.push(Sent::Other);
            }
            1 | 2 => {
                let mut properties = amqp::properties(u)?;
                if u.ratio(1, 3)? {
                    // Deep enough for the guard to act, as a frame from the broker can be.
                    let levels = u.int_in_range(MAX_HEADER_DEPTH - 2..=2000)?;
                    let mut v = AMQPValue::Void;
                    for _ in 0..levels {
                        v = AMQPValue::FieldArray(FieldArray::from(vec![v]));
                    }
                    let mut t = properties.headers().clone().unwrap_or_default();
                    t.insert(amqp::key(u)?, v);
                    properties = properties.with_headers(t);
                }
                let properties = amqp::wire_properties(&properties);
                let channel = u.int_in_range(1..=3)?;
                let Some(f) = header_frame(channel, u.arbitrary()?, &properties) else {
                    return Ok(std::ops::ControlFlow::Continue(()));
                };
                input.extend_from_slice(&f);
                sent.push(Sent::Header {
                    frame: f,
                    properties,
                    frame_max,
                });
            }
            3 => {
                let body: Vec<u8> = u.arbitrary()?;
                input.extend_from_slice(&frame(3, 1, &body));
                sent.push(Sent::Other);
            }
            _ => {
                input.extend_from_slice(&frame(8, 0, &[]));
                sent.push(Sent::Other);
            }
        }
        Ok(std::ops::ControlFlow::Continue(()))
    })?;
    Ok((input, sent))
}

fn frame(kind: u8, channel: u16, payload: &[u8]) -> Vec<u8> {
    let mut f = vec![kind];
    f.extend_from_slice(&channel.to_be_bytes());
    f.extend_from_slice(&(payload.len() as u32).to_be_bytes());
    f.extend_from_slice(payload);
    f.push(0xCE);
    f
}

/// What the guard made of a well-formed content header it was sent.
fn check_header(sent: &[u8], properties: &BasicProperties, frame_max: u32, got: &[u8]) {
    let empty = FieldTable::default();
    let headers = properties.headers().as_ref().unwrap_or(&empty);
    // A forged marker is dropped whatever it holds: it does not count as removed.
    let deepest = headers
        .inner()
        .iter()
        .filter(|(k, _)| k.as_str() != HEADERS_REMOVED)
        .map(|(_, v)| depth(v))
        .max()
        .unwrap_or(0);
    let forged = headers.contains_key(HEADERS_REMOVED);
    let limit = match frame_max {
        0 => usize::MAX,
        n => (n as usize).saturating_sub(8),
    };
    let payload = sent.len() - 8;
    if deepest <= MAX_HEADER_DEPTH && !forged && payload <= limit {
        assert_eq!(got, sent, "a header frame needing no change was changed");
        return;
    }
    if payload > limit {
        // The broker never sends a frame over the size it tuned; nothing more to require.
        return;
    }
    assert!(
        got.len() - 8 <= limit,
        "the rewritten frame exceeds the frame size"
    );
    let Ok((rest, AMQPFrame::Header(_, h))) = parse_frame(got) else {
        panic!("the rewritten header frame does not parse");
    };
    assert!(rest.is_empty());
    let mut expected = properties.clone();
    let mut actual = h.properties.clone();
    let got_headers = actual.headers().clone().unwrap_or_default();
    expected = expected.with_headers(FieldTable::default());
    actual = actual.with_headers(FieldTable::default());
    assert_eq!(
        format!("{expected:?}"),
        format!("{actual:?}"),
        "other properties changed"
    );
    let marker = got_headers.inner().get(HEADERS_REMOVED);
    let marker_text = match marker {
        Some(AMQPValue::LongString(s)) => String::from_utf8_lossy(s.as_bytes()).into_owned(),
        None => String::new(),
        Some(other) => panic!("the marker is not a string: {other:?}"),
    };
    if got_headers.inner().len() == 1 && marker_text.contains("does not fit the frame size") {
        // Removed whole: the rewrite would not fit the frame.
        return;
    }
    assert_eq!(
        marker.is_some(),
        deepest > MAX_HEADER_DEPTH,
        "marker {marker_text:?} with headers nested {deepest} levels; sent {:?}, got {:?}",
        headers
            .inner()
            .iter()
            .map(|(k, v)| (k, depth(v)))
            .collect::<Vec<_>>(),
        got_headers
            .inner()
            .iter()
            .map(|(k, v)| (k, depth(v)))
            .collect::<Vec<_>>(),
    );
    for (k, v) in headers.inner() {
        if k.as_str() == HEADERS_REMOVED {
            continue;
        }
        let now = got_headers.inner().get(k);
        if depth(v) <= MAX_HEADER_DEPTH {
            assert_eq!(
                format!("{now:?}"),
                format!("{:?}", Some(v)),
                "header {k:?} changed"
            );
        } else {
            assert!(
                matches!(now, Some(AMQPValue::LongString(_))),
                "header {k:?} nested {} levels became {now:?}",
                depth(v)
            );
        }
    }
    let known = |k: &ShortString| k.as_str() == HEADERS_REMOVED || headers.contains_key(k.as_str());
    assert!(got_headers.inner().keys().all(known), "headers appeared");
}
