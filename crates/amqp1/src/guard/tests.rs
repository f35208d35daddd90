use super::*;
use fe2o3_amqp::types::messaging::annotations::OwnedKey;
use fe2o3_amqp::types::messaging::message::DecodeIntoMessage;
use fe2o3_amqp::types::messaging::Body;
use fe2o3_amqp::types::primitives::Value;
use proptest::prelude::*;

// ---- encoders (the AMQP 1.0 type system, part 1) ----

fn list(items: &[Vec<u8>]) -> Vec<u8> {
    let body: Vec<u8> = items.concat();
    let mut v = vec![0xc0, (body.len() + 1) as u8, items.len() as u8];
    if body.len() + 1 > 255 {
        v = vec![0xd0];
        v.extend_from_slice(&((body.len() + 4) as u32).to_be_bytes());
        v.extend_from_slice(&(items.len() as u32).to_be_bytes());
    }
    v.extend_from_slice(&body);
    v
}

fn map(pairs: &[(Vec<u8>, Vec<u8>)]) -> Vec<u8> {
    let items: Vec<Vec<u8>> = pairs
        .iter()
        .flat_map(|(k, v)| [k.clone(), v.clone()])
        .collect();
    let mut l = list(&items);
    l[0] = if l[0] == 0xc0 { 0xc1 } else { 0xd1 };
    l
}

fn sym(s: &str) -> Vec<u8> {
    let mut v = vec![0xa3, s.len() as u8];
    v.extend_from_slice(s.as_bytes());
    v
}

fn string(s: &str) -> Vec<u8> {
    let mut v = vec![0xa1, s.len() as u8];
    v.extend_from_slice(s.as_bytes());
    v
}

fn described(code: u8, value: &[u8]) -> Vec<u8> {
    let mut v = vec![0x00, 0x53, code];
    v.extend_from_slice(value);
    v
}

/// An array32 of arrays, `depth` levels in all (the innermost holds one int). fe2o3 reads it
/// (one element each), the guard turns the outermost into a binary.
fn arrays(depth: usize) -> Vec<u8> {
    // Element data of the innermost array: constructor int, one element.
    let mut inner = vec![0x71, 0, 0, 0, 7];
    let mut count = 1u32;
    for level in 0..depth {
        let mut v = Vec::new();
        if level + 1 < depth {
            // An element of the outer array: size, count, then this array's body.
            let mut body = count.to_be_bytes().to_vec();
            body.extend_from_slice(&inner);
            v.extend_from_slice(&(body.len() as u32).to_be_bytes());
            v.extend_from_slice(&body);
            inner = [vec![0xf0], v].concat();
            count = 1;
        } else {
            let mut body = count.to_be_bytes().to_vec();
            body.extend_from_slice(&inner);
            v.push(0xf0);
            v.extend_from_slice(&(body.len() as u32).to_be_bytes());
            v.extend_from_slice(&body);
            inner = v;
        }
    }
    inner
}

/// `depth` levels: lists around an array of two ints (1: the array alone).
fn array_in_lists(depth: usize) -> Vec<u8> {
    let mut v = array8(&[0x71], 2, &[0, 0, 0, 1, 0, 0, 0, 2]);
    for _ in 1..depth {
        v = list(&[v]);
    }
    v
}

/// An array8: its element constructor, `count` elements (their data, without constructor).
fn array8(ctor: &[u8], count: u8, elements: &[u8]) -> Vec<u8> {
    let size = 1 + ctor.len() + elements.len();
    [
        vec![0xe0, size as u8, count],
        ctor.to_vec(),
        elements.to_vec(),
    ]
    .concat()
}

fn array32(ctor: &[u8], count: u32, elements: &[u8]) -> Vec<u8> {
    let size = 4 + ctor.len() + elements.len();
    [
        vec![0xf0],
        (size as u32).to_be_bytes().to_vec(),
        count.to_be_bytes().to_vec(),
        ctor.to_vec(),
        elements.to_vec(),
    ]
    .concat()
}

/// Two death records as RabbitMQ 4.x writes `x-opt-deaths`: an array whose element constructor
/// is a described map (descriptor `0x00 0x53 code`, then map8), and the maps' bodies.
fn deaths(wide: bool) -> Vec<u8> {
    let record = |queue: &str, count: u8| {
        map(&[
            (sym("queue"), string(queue)),
            (sym("reason"), sym("expired")),
            (sym("count"), vec![0x53, count]),
            (sym("time"), vec![0x83, 0, 0, 1, 0x8f, 0, 0, 0, 0]),
            (sym("routing-keys"), array8(&[0xa1], 1, &[1, b'q'])),
        ])[1..]
            .to_vec()
    };
    let elements = [record("orders.delay.1", 1), record("orders", 2)].concat();
    if wide {
        array32(&[0x00, 0x53, 0x33, 0xc1], 2, &elements)
    } else {
        array8(&[0x00, 0x53, 0x33, 0xc1], 2, &elements)
    }
}

/// A message whose message annotations carry `value` under `x-opt-deaths`.
fn annotated(value: &[u8]) -> Vec<u8> {
    [
        described(0x70, &list(&[vec![0x41]])),
        described(
            0x72,
            &map(&[
                (sym("x-first-death-queue"), string("orders")),
                (sym("x-opt-deaths"), value.to_vec()),
            ]),
        ),
        described(0x77, &string("the body")),
    ]
    .concat()
}

/// The binary an array becomes: the bytes after its size field.
fn as_binary(array: &[u8]) -> Value {
    let skip = if array[0] == 0xe0 { 2 } else { 5 };
    Value::Binary(serde_amqp::primitives::Binary::from(array[skip..].to_vec()))
}

/// Decodes as fe2o3's receiver does; the message annotations and the body, or the error.
fn decode_full(payload: Vec<u8>) -> Result<(Vec<(String, Value)>, String), String> {
    std::thread::Builder::new()
        .stack_size(1024 * 1024)
        .spawn(move || {
            let reader = serde_amqp::read::SliceReader::new(&payload);
            <Body<Value> as DecodeIntoMessage>::decode_message_from_reader(reader)
                .map(|m| {
                    let ann = m.message_annotations.map_or_else(Vec::new, |a| {
                        a.0.into_iter()
                            .map(|(k, v)| match k {
                                OwnedKey::Symbol(s) => (s.0, v),
                                OwnedKey::Ulong(n) => (n.to_string(), v),
                            })
                            .collect()
                    });
                    (ann, format!("{:?}", m.body))
                })
                .map_err(|e| format!("{e:?}"))
        })
        .unwrap()
        .join()
        .unwrap_or_else(|_| Err("the decoder panicked".into()))
}

/// `depth` levels of lists (1: a list holding a null).
fn lists(depth: usize) -> Vec<u8> {
    let mut v = vec![0x40];
    for _ in 0..depth {
        v = list(&[v]);
    }
    v
}

/// `depth` levels of maps, one entry each.
fn maps(depth: usize) -> Vec<u8> {
    let mut v = vec![0x40];
    for _ in 0..depth {
        v = map(&[(string("k"), v)]);
    }
    v
}

/// A message: header, message annotations, application properties and an amqp-value body.
fn message(body_value: &[u8]) -> Vec<u8> {
    [
        described(0x70, &list(&[vec![0x41]])),
        described(0x72, &map(&[(sym("x-opt-a"), string("b"))])),
        described(0x74, &map(&[(string("k"), vec![0x52, 3])])),
        described(0x77, body_value),
    ]
    .concat()
}

/// A `transfer` performative.
fn transfer(handle: u32, delivery_id: Option<u32>, more: bool) -> Vec<u8> {
    let mut fields = vec![vec![0x70], vec![0x40], vec![0x40], vec![0x43], vec![0x42]];
    fields[0].extend_from_slice(&handle.to_be_bytes());
    if let Some(id) = delivery_id {
        fields[1] = [vec![0x70], id.to_be_bytes().to_vec()].concat();
        fields[2] = vec![0xa0, 1, id as u8];
    }
    fields.push(vec![if more { 0x41 } else { 0x42 }]);
    described(0x14, &list(&fields))
}

fn frame(kind: u8, channel: u16, body: &[u8]) -> Vec<u8> {
    let mut f = ((body.len() + 8) as u32).to_be_bytes().to_vec();
    f.extend_from_slice(&[2, kind]);
    f.extend_from_slice(&channel.to_be_bytes());
    f.extend_from_slice(body);
    f
}

fn transfer_frame(
    channel: u16,
    handle: u32,
    id: Option<u32>,
    more: bool,
    payload: &[u8],
) -> Vec<u8> {
    frame(
        0,
        channel,
        &[transfer(handle, id, more), payload.to_vec()].concat(),
    )
}

/// The opening of a connection: protocol headers, SASL frames, an `open`.
fn opening() -> Vec<u8> {
    [
        b"AMQP\x03\x01\x00\x00".to_vec(),
        frame(1, 0, &described(0x40, &list(&[vec![0xe0, 2, 1, 0xa3]]))),
        frame(1, 0, &described(0x44, &list(&[vec![0x50, 0]]))),
        b"AMQP\x00\x01\x00\x00".to_vec(),
        frame(0, 0, &described(0x10, &list(&[string("rabbit")]))),
        frame(0, 0, &[]),
    ]
    .concat()
}

// ---- running the guard ----

/// A reader that hands out the input in the given chunk sizes (cycled).
struct Chunked {
    data: Vec<u8>,
    pos: usize,
    sizes: Vec<usize>,
    turn: usize,
}

impl AsyncRead for Chunked {
    fn poll_read(
        mut self: Pin<&mut Self>,
        _cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let size = self.sizes[self.turn % self.sizes.len()].max(1);
        self.turn += 1;
        let n = size.min(buf.remaining()).min(self.data.len() - self.pos);
        let start = self.pos;
        buf.put_slice(&self.data[start..start + n]);
        self.pos += n;
        Poll::Ready(Ok(()))
    }
}

/// Everything fe2o3 would read, through a [`GuardedStream`] over reads of `sizes`, into
/// buffers of `read_size`.
fn through_sizes(input: &[u8], sizes: &[usize], read_size: usize, cuts: &Cuts) -> Vec<u8> {
    let reader = Chunked {
        data: input.to_vec(),
        pos: 0,
        sizes: sizes.to_vec(),
        turn: 0,
    };
    let mut s = GuardedStream::new(reader, cuts.clone());
    let waker = futures::task::noop_waker();
    let mut cx = Context::from_waker(&waker);
    let mut out = Vec::new();
    let mut buf = vec![0u8; read_size.max(1)];
    loop {
        let mut rb = ReadBuf::new(&mut buf);
        match Pin::new(&mut s).poll_read(&mut cx, &mut rb) {
            Poll::Ready(Ok(())) if rb.filled().is_empty() => return out,
            Poll::Ready(Ok(())) => out.extend_from_slice(rb.filled()),
            other => panic!("{other:?}"),
        }
    }
}

fn through(input: &[u8], chunk: usize) -> (Vec<u8>, Cuts) {
    let cuts = Cuts::new();
    let out = through_sizes(input, &[chunk], 4096, &cuts);
    (out, cuts)
}

/// The transfer payloads of a frame stream, by (channel, handle) in order, per delivery.
fn deliveries(stream: &[u8]) -> Vec<(u16, u32, Vec<u8>)> {
    let mut rest = stream;
    let mut open: HashMap<(u16, u32), Vec<u8>> = HashMap::new();
    let mut done = Vec::new();
    while !rest.is_empty() {
        if rest.starts_with(b"AMQP") {
            rest = &rest[8..];
            continue;
        }
        let size = u32::from_be_bytes([rest[0], rest[1], rest[2], rest[3]]) as usize;
        let (f, r) = rest.split_at(size);
        rest = r;
        let channel = u16::from_be_bytes([f[6], f[7]]);
        if f[5] != 0 || f.len() == 8 {
            continue;
        }
        let Some(t) = Transfer::parse(&f[8..]) else {
            continue;
        };
        let payload = &f[8 + t.payload_start..];
        open.entry((channel, t.handle))
            .or_default()
            .extend_from_slice(payload);
        if !t.more {
            let p = open.remove(&(channel, t.handle)).unwrap();
            done.push((channel, t.handle, p));
        }
    }
    done
}

/// Decodes a message as fe2o3's receiver does, on a thread with half the stack of a tokio
/// worker (1 MiB; a debug build needs about 9 KiB per level): a guard that let deep nesting
/// through would overflow it.
fn decode(payload: Vec<u8>) -> Result<String, String> {
    std::thread::Builder::new()
        .stack_size(1024 * 1024)
        .spawn(move || {
            let reader = serde_amqp::read::SliceReader::new(&payload);
            <Body<Value> as DecodeIntoMessage>::decode_message_from_reader(reader)
                .map(|m| format!("{:?}", m.body))
                .map_err(|e| format!("{e:?}"))
        })
        .unwrap()
        .join()
        .unwrap()
}

const DEEP: &str = "a value nested deeper than 32 levels was cut on receipt (nesting guard)";

// ---- tests ----

#[test]
fn a_connection_with_valid_messages_passes_byte_for_byte_at_every_read_boundary() {
    let input = [
        opening(),
        transfer_frame(1, 0, Some(0), false, &message(&lists(10))),
        transfer_frame(1, 0, Some(1), false, &message(&maps(5))),
        transfer_frame(1, 0, Some(2), false, &message(&array_in_lists(5))),
        frame(0, 0, &[]),
    ]
    .concat();
    for chunk in 1..=input.len().min(300) {
        let (out, cuts) = through(&input, chunk);
        assert_eq!(out, input, "chunk {chunk}");
        assert_eq!(cuts.take(0), None);
    }
    let (out, _) = through(&input, usize::MAX);
    assert_eq!(out, input);
    for (_, _, p) in deliveries(&out) {
        decode(p).expect("decodes");
    }
}

#[test]
fn nesting_at_the_limit_passes_and_one_deeper_is_cut() {
    // The body section is level 1, so its value may nest MAX_NESTING - 1 levels.
    for (name, build) in [
        ("lists", lists as fn(usize) -> Vec<u8>),
        ("maps", maps),
        ("an array in lists", array_in_lists),
    ] {
        let ok = transfer_frame(1, 0, Some(7), false, &message(&build(MAX_NESTING - 1)));
        let (out, cuts) = through(&ok, 3);
        assert_eq!(out, ok, "{name}");
        assert_eq!(cuts.take(7), None, "{name}");
        decode(deliveries(&out).remove(0).2).expect("decodes");

        let deep = transfer_frame(1, 0, Some(8), false, &message(&build(MAX_NESTING)));
        let (out, cuts) = through(&deep, 3);
        assert!(out.len() < deep.len(), "{name}");
        assert_eq!(cuts.take(8).as_deref(), Some(DEEP), "{name}");
        assert_eq!(cuts.take(8), None, "taken once");
        let err = decode(deliveries(&out).remove(0).2).expect_err("a cut message fails");
        // At a constructor (an array's element constructor too) the mark is refused.
        assert!(
            err.contains("nvalid format code") || err.contains("InvalidFormatCode"),
            "{err}"
        );
    }
}

#[test]
fn thousands_of_levels_are_cut_and_the_rest_decodes_on_a_small_stack() {
    for payload in [
        message(&lists(5000)),
        message(&maps(3000)),
        message(&array_in_lists(3000)),
        // Described values nest too: 0x00 0x00 0x00 ... (a descriptor that is itself
        // described), then a chain of described values.
        [vec![0x00; 4000], vec![0x40]].concat(),
        (0..3000)
            .flat_map(|_| [0x00, 0x53, 0x77])
            .chain([0x40])
            .collect(),
    ] {
        let input = transfer_frame(0, 3, Some(42), false, &payload);
        let (out, cuts) = through(&input, 1000);
        assert_eq!(cuts.take(42).as_deref(), Some(DEEP));
        decode(deliveries(&out).remove(0).2).expect_err("cut");
    }
}

#[test]
fn a_delivery_over_several_frames_is_cut_in_the_frame_that_goes_too_deep_and_after() {
    let payload = message(&lists(40));
    // The body's lists start at about 30 bytes; level 33 is at about 30 + 2 * 32.
    // Sections take 39 bytes, then 3 bytes a list: level 33 starts at byte 132.
    let parts = [
        &payload[..20],
        &payload[20..120],
        &payload[120..135],
        &payload[135..],
    ];
    let mut input = opening();
    for (i, part) in parts.iter().enumerate() {
        let id = (i == 0).then_some(5);
        input.extend(transfer_frame(1, 2, id, i + 1 < parts.len(), part));
    }
    input.extend(transfer_frame(1, 2, Some(6), false, &message(&lists(3))));
    for chunk in [1, 2, 7, 64, 100_000] {
        let (out, cuts) = through(&input, chunk);
        assert_eq!(cuts.take(5).as_deref(), Some(DEEP), "chunk {chunk}");
        assert_eq!(cuts.take(6), None);
        let d = deliveries(&out);
        assert_eq!(d.len(), 2);
        // Two frames pass whole, the third is cut at level 33, the fourth is empty.
        assert_eq!(d[0].2, [&payload[..132], &[CUT_MARK]].concat());
        decode(d[0].2.clone()).expect_err("cut");
        assert_eq!(d[1].2, message(&lists(3)));
        decode(d[1].2.clone()).expect("the next delivery decodes");
    }
}

#[test]
fn a_cut_in_the_third_frame() {
    let payload = message(&maps(40));
    let n = payload.len();
    let cut_frames = [
        &payload[..10],
        &payload[10..25],
        &payload[25..n - 1],
        &payload[n - 1..],
    ];
    let mut input = Vec::new();
    for (i, part) in cut_frames.iter().enumerate() {
        input.extend(transfer_frame(4, 1, (i == 0).then_some(9), i < 3, part));
    }
    let (out, cuts) = through(&input, 5);
    assert_eq!(cuts.take(9).as_deref(), Some(DEEP));
    let d = deliveries(&out);
    assert_eq!(&d[0].2[..25], &payload[..25]);
    assert!(d[0].2.len() < payload.len());
}

#[test]
fn interleaved_links_are_scanned_apart() {
    // Two links on two sessions, each mid-delivery while the other sends.
    let deep = message(&lists(50));
    let fine = message(&lists(20));
    let input = [
        transfer_frame(1, 0, Some(1), true, &deep[..40]),
        transfer_frame(2, 0, Some(1), true, &fine[..40]),
        transfer_frame(1, 1, Some(2), true, &fine[..35]),
        transfer_frame(1, 0, None, false, &deep[40..]),
        transfer_frame(2, 0, None, false, &fine[40..]),
        transfer_frame(1, 1, None, false, &fine[35..]),
    ]
    .concat();
    let (out, cuts) = through(&input, 11);
    let d = deliveries(&out);
    assert_eq!(d.len(), 3);
    assert_eq!((d[0].0, d[0].1), (1, 0));
    decode(d[0].2.clone()).expect_err("cut");
    assert_eq!(d[1].2, fine);
    assert_eq!(d[2].2, fine);
    assert_eq!(cuts.take(1).as_deref(), Some(DEEP));
    assert_eq!(cuts.take(2), None);
}

/// `x-opt-deaths` as RabbitMQ 4.0.5 and 4.3.6 write it (seen in tests/guard.rs): an array8 of
/// one map32.
fn rabbitmq_deaths() -> Vec<u8> {
    let entries = [
        (sym("queue"), string("orders.delay.1")),
        (sym("reason"), sym("expired")),
        (sym("count"), vec![0x53, 1]),
        (sym("exchange"), string("")),
    ];
    let items: Vec<u8> = entries
        .iter()
        .flat_map(|(k, v)| [k.clone(), v.clone()])
        .flatten()
        .collect();
    let mut map32 = ((items.len() + 4) as u32).to_be_bytes().to_vec();
    map32.extend_from_slice(&8u32.to_be_bytes());
    map32.extend_from_slice(&items);
    array8(&[0xd1], 1, &map32)
}

#[test]
fn x_opt_deaths_decodes_as_a_binary_of_the_same_bytes() {
    for (wide, arr) in [
        (false, rabbitmq_deaths()),
        (false, deaths(false)),
        (true, deaths(true)),
    ] {
        let payload = annotated(&arr);
        // fe2o3 alone refuses it.
        let alone = decode_full(payload.clone()).unwrap_err();
        assert!(
            matches!(alone.as_str(), "InvalidFormatCode" | "InvalidValue"),
            "{alone}"
        );
        let input = transfer_frame(1, 0, Some(4), false, &payload);
        let at = input.len() - payload.len() + find(&payload, &arr);
        for chunk in [1, 2, 3, 7, 100_000] {
            let (out, cuts) = through(&input, chunk);
            assert_eq!(cuts.take(4), None);
            // One byte changed, no length.
            assert_eq!(out.len(), input.len());
            let diff: Vec<usize> = (0..out.len()).filter(|&i| out[i] != input[i]).collect();
            assert_eq!(diff, [at]);
            assert_eq!(out[at], if wide { 0xb0 } else { 0xa0 });
            let (ann, body) = decode_full(deliveries(&out).remove(0).2).expect("decodes");
            assert_eq!(
                ann[0],
                ("x-first-death-queue".into(), Value::from("orders"))
            );
            assert_eq!(ann[1], ("x-opt-deaths".into(), as_binary(&arr)));
            assert!(body.contains("the body"), "{body}");
        }
    }
}

fn find(haystack: &[u8], needle: &[u8]) -> usize {
    haystack
        .windows(needle.len())
        .position(|w| w == needle)
        .unwrap()
}

const SPLIT: &str = "the message was cut on receipt at an array of described or compound values \
                     that fe2o3 cannot decode, whose head was split over two transfer frames, so \
                     it could not be passed on as a binary (nesting guard)";

/// The byte strings of docs/upstream/serde_amqp-described-arrays.md.
#[test]
fn the_upstream_report_reproductions() {
    let described = [
        0x00, 0x53, 0x77, 0xe0, 0x0b, 0x01, 0x00, 0x53, 0x33, 0xc1, 0x05, 0x02, 0x53, 0x01, 0x53,
        0x02,
    ];
    let maps = [
        0x00, 0x53, 0x77, 0xe0, 0x08, 0x01, 0xc1, 0x05, 0x02, 0x53, 0x01, 0x53, 0x02,
    ];
    let lists = [
        0x00, 0x53, 0x77, 0xe0, 0x08, 0x02, 0xc0, 0x02, 0x01, 0x40, 0x02, 0x01, 0x40,
    ];
    for (what, payload, err) in [
        ("described", &described[..], "InvalidFormatCode"),
        ("maps", &maps[..], ""),
        ("lists", &lists[..], "Invalid format code"),
    ] {
        let alone = decode_full(payload.to_vec()).expect_err(what);
        assert!(alone.contains(err), "{what}: {alone}");
        let input = transfer_frame(0, 0, Some(1), false, payload);
        let (out, cuts) = through(&input, 1);
        assert_eq!(cuts.take(1), None);
        let (_, body) = decode_full(deliveries(&out).remove(0).2).expect(what);
        assert!(body.contains("Binary"), "{what}: {body}");
    }
}

#[test]
fn deaths_split_over_frames_at_every_offset() {
    for wide in [false, true] {
        let arr = deaths(wide);
        let payload = annotated(&arr);
        let start = find(&payload, &arr);
        // The array's constructor, size and count, then its element constructor.
        let head = if wide { 9 } else { 3 };
        for split in 0..=payload.len() {
            let input = [
                transfer_frame(2, 1, Some(9), true, &payload[..split]),
                transfer_frame(2, 1, None, false, &payload[split..]),
            ]
            .concat();
            let (out, cuts) = through(&input, 5);
            let got = deliveries(&out).remove(0).2;
            if start < split && split <= start + head {
                // The constructor went out with the first frame, before the element
                // constructor said it is to be a binary.
                assert_eq!(cuts.take(9).as_deref(), Some(SPLIT), "split {split}");
                decode_full(got).expect_err("cut");
            } else {
                assert_eq!(cuts.take(9), None, "split {split}");
                let (ann, _) = decode_full(got).unwrap_or_else(|e| panic!("{split}: {e}"));
                assert_eq!(ann[1].1, as_binary(&arr), "split {split}");
            }
        }
    }
}

#[test]
fn arrays_fe2o3_misreads_become_binaries_the_rest_pass() {
    let m1 = map(&[(sym("count"), vec![0x53, 1])]);
    let m2 = map(&[(sym("reason"), sym("expired"))]);
    let l1 = list(&[vec![0x53, 1]]);
    let l2 = list(&[vec![0x40], vec![0x41]]);
    let a1 = array8(&[0x71], 1, &[0, 0, 0, 7]);
    let a2 = array8(&[0x71], 2, &[0, 0, 0, 7, 0, 0, 0, 8]);
    let s = |b: &[u8]| b[1..].to_vec();
    // Element constructor, count: what fe2o3 0.18 does with it alone.
    let rewritten = [
        (
            "described maps",
            array8(&[0x00, 0x53, 0x33, 0xc1], 1, &s(&m1)),
        ),
        (
            "described strings, a string descriptor",
            array8(&[0x00, 0xa1, 1, b'u', 0xa1], 2, &[1, b'a', 1, b'b']),
        ),
        (
            "described, empty",
            array8(&[0x00, 0x53, 0x33, 0xc1], 0, &[]),
        ),
        ("maps", array8(&[0xc1], 1, &s(&m1))),
        (
            "maps (a debug build panics)",
            array8(&[0xc1], 2, &[s(&m1), s(&m2)].concat()),
        ),
        ("map32s", array32(&[0xc1], 2, &[s(&m1), s(&m2)].concat())),
        ("lists", array8(&[0xc0], 2, &[s(&l1), s(&l2)].concat())),
        ("arrays", array8(&[0xe0], 2, &[s(&a1), s(&a2)].concat())),
        ("empty, with a constructor", array8(&[0x71], 0, &[])),
        ("empty, null constructor", array32(&[0x40], 0, &[])),
        ("more nulls than bytes", array8(&[0x40], 3, &[])),
        ("more list0s than bytes", array32(&[0x45], 9, &[])),
    ];
    for (what, arr) in &rewritten {
        let payload = annotated(arr);
        let alone = decode_full(payload.clone());
        assert!(alone.is_err(), "{what}: fe2o3 reads it now: {alone:?}");
        let input = transfer_frame(0, 0, Some(1), false, &payload);
        let (out, cuts) = through(&input, 3);
        assert_eq!(cuts.take(1), None, "{what}");
        let (ann, _) = decode_full(deliveries(&out).remove(0).2).expect(what);
        assert_eq!(ann[1].1, as_binary(arr), "{what}");
    }
    // Read right by fe2o3 alone (one list or array: by luck) and kept, except those.
    let kept = [
        ("one list", array8(&[0xc0], 1, &s(&l1)), false),
        ("one array", array8(&[0xe0], 1, &s(&a1)), false),
        ("list0s", array8(&[0x45], 2, &[]), true),
        ("ints", array8(&[0x71], 2, &[0, 0, 0, 1, 0, 0, 0, 2]), true),
        ("strings", array32(&[0xa1], 2, &[1, b'a', 1, b'b']), true),
        ("symbols", array8(&[0xb3], 1, &[0, 0, 0, 1, b'a']), true),
        ("booleans", array8(&[0x56], 2, &[1, 0]), true),
        ("nulls", array8(&[0x40], 2, &[]), true),
        ("uuids", array8(&[0x98], 1, &[7; 16]), true),
    ];
    for (what, arr, stays) in &kept {
        let payload = annotated(arr);
        let (alone, _) = decode_full(payload.clone()).expect(what);
        let input = transfer_frame(0, 0, Some(1), false, &payload);
        let (out, cuts) = through(&input, 3);
        assert_eq!(cuts.take(1), None, "{what}");
        let (ann, _) = decode_full(deliveries(&out).remove(0).2).expect(what);
        if *stays {
            assert_eq!(out, input, "{what}");
            assert_eq!(ann, alone, "{what}");
        } else {
            // Lists and arrays as elements: a binary, whatever the count (see needs_binary).
            assert_eq!(ann[1].1, as_binary(arr), "{what}");
        }
    }
}

#[test]
fn described_arrays_nested_in_maps_lists_and_bodies() {
    let arr = deaths(false);
    let body = map(&[
        (string("deaths"), arr.clone()),
        (
            string("more"),
            list(&[deaths(true), vec![0x53, 7], arr.clone()]),
        ),
    ]);
    let payload = message(&body);
    let input = transfer_frame(0, 0, Some(2), false, &payload);
    let (out, cuts) = through(&input, 1);
    assert_eq!(cuts.take(2), None);
    assert_eq!(out.len(), input.len());
    assert_eq!((0..out.len()).filter(|&i| out[i] != input[i]).count(), 3);
    let (_, body) = decode_full(deliveries(&out).remove(0).2).expect("decodes");
    assert_eq!(body.matches("Binary").count(), 3, "{body}");
    assert!(body.contains("Ulong(7)"), "{body}");
}

#[test]
fn depth_with_arrays_turned_into_binaries() {
    // A binary is no level: a described array as the 32nd level's value is fine, and so is
    // anything inside it, however deep (never decoded).
    let inside_deep = array8(&[0x00, 0x53, 0x33, 0xc0], 1, &lists(80)[1..]);
    let mut at_the_limit = inside_deep.clone();
    for _ in 0..MAX_NESTING - 1 {
        at_the_limit = list(&[at_the_limit]);
    }
    for payload in [
        described(0x77, &at_the_limit),
        message(&arrays(3000)),
        message(&list(std::slice::from_ref(&inside_deep))),
    ] {
        let input = transfer_frame(0, 0, Some(3), false, &payload);
        let (out, cuts) = through(&input, 7);
        assert_eq!(cuts.take(3), None);
        decode_full(deliveries(&out).remove(0).2).expect("decodes");
    }
    // An array kept as an array is a level: at 32, fine; at 33, cut.
    for (levels, cut) in [(MAX_NESTING - 1, false), (MAX_NESTING, true)] {
        let payload = described(0x77, &array_in_lists(levels));
        let input = transfer_frame(0, 0, Some(3), false, &payload);
        let (out, cuts) = through(&input, 2);
        let got = decode_full(deliveries(&out).remove(0).2);
        if cut {
            assert_eq!(cuts.take(3).as_deref(), Some(DEEP));
            got.expect_err("cut");
        } else {
            assert_eq!(out, input);
            got.expect("decodes");
        }
    }
    // Deep lists and maps beside a binary are still cut.
    let payload = message(&list(&[deaths(false), lists(40)]));
    let input = transfer_frame(0, 0, Some(3), false, &payload);
    let (out, cuts) = through(&input, 2);
    assert_eq!(cuts.take(3).as_deref(), Some(DEEP));
    decode_full(deliveries(&out).remove(0).2).expect_err("cut");
}

#[test]
fn malformed_encodings_are_cut_with_a_reason() {
    for (payload, what) in [
        (
            described(0x77, &[0xc0, 3, 1, 0x40, 0x40]),
            "size and count disagree",
        ),
        (
            described(0x77, &[0xc0, 3, 5, 0x40, 0x40, 0x40, 0x40]),
            "more elements",
        ),
        (described(0x77, &[0xc0, 1, 1, 0x40, 0x40]), "more elements"),
        (described(0x77, &[0x3f, 1, 2]), "unknown constructor"),
        (
            described(0x77, &[0xc0, 2, 1, 0xa1, 9, 1, 2, 3]),
            "larger than",
        ),
        (
            described(0x77, &[0xc0, 0, 0, 0x40]),
            "smaller than its own count",
        ),
    ] {
        let input = transfer_frame(0, 0, Some(3), false, &payload);
        let (out, cuts) = through(&input, 2);
        let why = cuts.take(3).unwrap_or_default();
        assert!(why.contains(what), "{what}: {why}");
        let d = deliveries(&out);
        decode(d[0].2.clone()).expect_err("cut");
    }
    // A payload ending inside a list: nothing withheld, the decoder reports it.
    let short = transfer_frame(0, 0, Some(4), false, &described(0x77, &[0xc0, 5, 2, 0x40]));
    let (out, cuts) = through(&short, 2);
    assert_eq!(out, short);
    assert_eq!(cuts.take(4), None);
}

#[test]
fn aborted_and_odd_frames_pass() {
    let deep = message(&lists(60));
    // Field 9 (aborted) true, handle 0.
    let mut fields = vec![vec![0x43], vec![0x40], vec![0x40], vec![0x40], vec![0x40]];
    fields.extend([vec![0x42], vec![0x40], vec![0x40], vec![0x40], vec![0x41]]);
    let aborted = described(0x14, &list(&fields));
    // A transfer named by its symbol, its fields in a list32: handle 0, delivery-id 0.
    let mut by_name = vec![0x00];
    by_name.extend(sym("amqp:transfer:list"));
    by_name.extend([0xd0, 0, 0, 0, 6, 0, 0, 0, 2, 0x43, 0x43]);
    let input = [
        transfer_frame(0, 0, Some(1), true, &deep[..50]),
        frame(0, 0, &aborted),
        // Not a performative, an unknown frame type: passed as they are.
        frame(0, 0, &[0xa1, 1, b'x']),
        frame(3, 0, &[9, 9, 9, 9]),
    ]
    .concat();
    let last = frame(0, 0, &[by_name, message(&lists(40))].concat());
    let input = [input, last.clone()].concat();
    let (out, cuts) = through(&input, 3);
    // Delivery 1 was aborted before it went too deep; delivery 0 is cut.
    assert_eq!(cuts.take(1), None);
    assert_eq!(cuts.take(0).as_deref(), Some(DEEP));
    let before = input.len() - last.len();
    assert_eq!(out[..before], input[..before]);
    assert!(out.len() < input.len());
    // A size below 8: passed on with everything after it.
    let bad = [0, 0, 0, 3, 1, 2, 3, 4, 5];
    assert_eq!(through(&bad, 1).0, bad);
}

#[test]
fn cuts_keep_at_most_max_cuts() {
    let cuts = Cuts::new();
    for id in 0..(MAX_CUTS as u32 + 10) {
        cuts.record(id, format!("{id}"));
    }
    assert_eq!(cuts.take(0), None);
    assert_eq!(cuts.take(9), None);
    assert_eq!(cuts.take(10).as_deref(), Some("10"));
    assert_eq!(cuts.take(MAX_CUTS as u32 + 9).as_deref(), Some("1033"));
}

#[test]
fn a_large_frame_is_read_without_quadratic_copying() {
    // 200,000 strings in one 1.2 MB frame, read 1 KiB at a time.
    let items: Vec<Vec<u8>> = (0..200_000).map(|_| string("abc")).collect();
    let payload = described(0x77, &list(&items));
    let input = transfer_frame(0, 0, Some(1), false, &payload);
    let started = std::time::Instant::now();
    let (out, _) = through(&input, 1024);
    assert_eq!(out, input);
    assert!(started.elapsed() < std::time::Duration::from_secs(5));
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    #[test]
    fn valid_streams_pass_unchanged_whatever_the_reads(
        sizes in proptest::collection::vec(1usize..64, 1..8),
        read_size in 1usize..200,
        depth in 0usize..30,
        split in 1usize..60,
    ) {
        let payload = message(&lists(depth));
        let split = split.min(payload.len());
        let input = [
            opening(),
            transfer_frame(1, 0, Some(1), true, &payload[..split]),
            transfer_frame(1, 0, None, false, &payload[split..]),
            transfer_frame(1, 0, Some(2), false, &message(&maps(depth))),
        ].concat();
        let cuts = Cuts::new();
        prop_assert_eq!(through_sizes(&input, &sizes, read_size, &cuts), input);
        prop_assert_eq!(cuts.take(1), None);
    }

    #[test]
    fn arbitrary_bytes_do_not_panic(
        data in proptest::collection::vec(any::<u8>(), 0..600),
        sizes in proptest::collection::vec(1usize..64, 1..4),
    ) {
        let cuts = Cuts::new();
        let whole = through_sizes(&data, &[usize::MAX], 4096, &cuts);
        prop_assert_eq!(through_sizes(&data, &sizes, 7, &cuts), whole);
        // Wrapped in a transfer, as a publisher's payload.
        let framed = transfer_frame(0, 0, Some(1), false, &data);
        let out = through_sizes(&framed, &sizes, 100, &cuts);
        prop_assert!(out.len() <= framed.len());
        for (_, _, p) in deliveries(&out) {
            let _ = decode(p);
        }
    }
}

#[test]
#[ignore = "a measurement"]
fn measure_stack_per_level() {
    for depth in [10usize, 31, 100, 200] {
        let ok = |stack: usize| {
            let exe = std::env::current_exe().unwrap();
            let out = std::process::Command::new(exe)
                .args(["--ignored", "--exact", "guard::tests::probe", "--nocapture"])
                .env("PROBE_STACK", stack.to_string())
                .env("PROBE_DEPTH", depth.to_string())
                .output()
                .unwrap();
            out.status.success()
        };
        let (mut lo, mut hi) = (16 * 1024usize, 64 * 1024 * 1024usize);
        while hi - lo > 4096 {
            let mid = (lo + hi) / 2;
            if ok(mid) {
                hi = mid
            } else {
                lo = mid
            }
        }
        eprintln!("depth {depth}: needs about {} KiB", hi / 1024);
    }
}

#[test]
#[ignore = "run by measure_stack_per_level"]
fn probe() {
    let stack: usize = std::env::var("PROBE_STACK").unwrap().parse().unwrap();
    let depth: usize = std::env::var("PROBE_DEPTH").unwrap().parse().unwrap();
    let payload = message(&lists(depth));
    std::thread::Builder::new()
        .stack_size(stack)
        .spawn(move || {
            let reader = serde_amqp::read::SliceReader::new(&payload);
            let m = <Body<Value> as DecodeIntoMessage>::decode_message_from_reader(reader);
            assert!(m.is_ok());
        })
        .unwrap()
        .join()
        .unwrap();
}

/// A broker's link flow reaches fe2o3 without its delivery count (which fe2o3 would take over
/// its own, counting waiting transfers twice); every other field, and other frames, unchanged.
#[test]
fn a_link_flow_loses_its_delivery_count_and_nothing_else() {
    use fe2o3_amqp::types::performatives::Flow;
    let flow = Flow {
        next_incoming_id: Some(0),
        incoming_window: 400,
        next_outgoing_id: 40,
        outgoing_window: u32::MAX,
        handle: Some(0.into()),
        delivery_count: Some(40),
        link_credit: Some(0),
        available: Some(2613),
        drain: false,
        echo: false,
        properties: None,
    };
    let body = serde_amqp::to_vec(&flow).unwrap();
    let mut frame = ((8 + body.len()) as u32).to_be_bytes().to_vec();
    frame.extend_from_slice(&[2, 0, 0, 0]);
    frame.extend_from_slice(&body);
    let mut guard = super::frame_guard(super::Cuts::default());
    guard.feed(&frame);
    let out = guard.pending().to_vec();
    assert!(out.len() < frame.len(), "the count is gone");
    assert_eq!(
        u32::from_be_bytes([out[0], out[1], out[2], out[3]]) as usize,
        out.len()
    );
    let seen: Flow = serde_amqp::from_slice(&out[8..]).unwrap();
    assert_eq!(seen.delivery_count, None);
    assert_eq!(seen.link_credit, Some(0));
    assert_eq!(seen.available, Some(2613));
    assert_eq!(seen.handle, Some(0.into()));
    // A session flow (no handle, no count) passes as it came.
    let session = Flow {
        handle: None,
        delivery_count: None,
        link_credit: None,
        available: None,
        ..flow
    };
    let body = serde_amqp::to_vec(&session).unwrap();
    let mut frame = ((8 + body.len()) as u32).to_be_bytes().to_vec();
    frame.extend_from_slice(&[2, 0, 0, 0]);
    frame.extend_from_slice(&body);
    let mut guard = super::frame_guard(super::Cuts::default());
    guard.feed(&frame);
    assert_eq!(guard.pending(), &frame[..]);
}

/// A map whose count is odd (keys and values never are) is cut as malformed: serde_amqp 0.18
/// subtracts 2 per entry from the count, which overflows (found by the fuzz target).
#[test]
fn a_map_with_an_odd_count_is_cut() {
    use super::scan::Scanner;
    // map8: size 3, count 1, one key (null): a message-annotations section.
    let payload = [0x00, 0x53, 0x72, 0xc1, 0x02, 0x01, 0x40];
    let mut scanner = Scanner::default();
    assert!(scanner.feed(&mut payload.clone()).is_err());
    let even = [0x00, 0x53, 0x72, 0xc1, 0x03, 0x02, 0x40, 0x40];
    let mut scanner = Scanner::default();
    assert!(scanner.feed(&mut even.clone()).is_ok());
}

/// A compound head split over two frames: a size too small for its own count is cut in the
/// frame that holds it, before the bytes go on (found by the fuzz target: a map8 of size 0).
#[test]
fn a_split_compound_head_too_small_is_cut_before_it_goes_on() {
    use super::scan::Scanner;
    let mut scanner = Scanner::default();
    // amqp-value section, map8 whose size byte (0) ends the frame.
    let mut first = [0x00, 0x53, 0x77, 0xc1, 0x00];
    let cut = scanner.feed(&mut first).unwrap_err();
    assert_eq!(cut.0, 3, "cut at the map's constructor, in this frame");
}
