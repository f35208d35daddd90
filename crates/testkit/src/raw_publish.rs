//! Publishing hostile messages as an attacker would: AMQP 0-9-1 written by hand on a plain
//! socket, so what goes on the wire is exactly what the test wrote, and no client library of
//! ours builds, encodes or repairs it on the way: header tables nested as deep as a frame holds,
//! properties and routing keys that are not UTF-8. lapin cannot be the publisher here: it
//! encodes frames on its own 2 MiB I/O thread, recursively, and overflows it too; and it only
//! takes valid strings.
//!
//! Blocking I/O: call it from `tokio::task::spawn_blocking` in an async test.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::Duration;

use lapin::uri::AMQPUri;

const FRAME_END: u8 = 0xCE;

/// What the broker negotiated, and the header frame that was sent.
#[derive(Debug, Clone, Copy)]
pub struct Published {
    /// The broker's `frame_max` (`connection.tune`), which the publisher accepted.
    pub frame_max: u32,
    /// The content-header frame's size on the wire, head and end byte included.
    pub header_frame: usize,
}

/// A header value nesting `depth` arrays (`b'A'`) or tables (`b'F'`, one entry `k` each), built
/// without recursion.
pub fn nested(kind: u8, depth: usize) -> Vec<u8> {
    let step = if kind == b'F' { 7 } else { 5 };
    let mut v = Vec::with_capacity(depth * step);
    for i in 0..depth {
        // Level i holds level i+1: its 5-byte opening, and in a table the key before it.
        let inner = (depth - 1 - i) * step;
        v.push(kind);
        v.extend_from_slice(&(inner as u32).to_be_bytes());
        if kind == b'F' && i + 1 < depth {
            v.extend_from_slice(&[1, b'k']);
        }
    }
    v
}

/// Content-header payload: class basic, the body size, `headers` (one entry `h` = `value`),
/// delivery mode 2 and a message id.
fn header_payload(value: &[u8], body_len: usize, message_id: &str) -> Vec<u8> {
    header_payload_named("h", value, body_len, message_id)
}

/// [`header_payload`] with the header named `key` (at most 255 bytes).
fn header_payload_named(key: &str, value: &[u8], body_len: usize, message_id: &str) -> Vec<u8> {
    let mut p = vec![0, 60, 0, 0];
    p.extend_from_slice(&(body_len as u64).to_be_bytes());
    p.extend_from_slice(&((1u16 << 13) | (1 << 12) | (1 << 7)).to_be_bytes());
    p.extend_from_slice(&((value.len() + 1 + key.len()) as u32).to_be_bytes());
    p.push(key.len() as u8);
    p.extend_from_slice(key.as_bytes());
    p.extend_from_slice(value);
    p.push(2);
    p.push(message_id.len() as u8);
    p.extend_from_slice(message_id.as_bytes());
    p
}

/// The deepest nesting of `kind` whose content-header frame fits `frame_max`.
pub fn deepest(kind: u8, frame_max: u32, message_id: &str) -> usize {
    deepest_named(kind, frame_max, "h", message_id)
}

/// [`deepest`] for a header named `key`.
pub fn deepest_named(kind: u8, frame_max: u32, key: &str, message_id: &str) -> usize {
    let fixed = header_payload_named(key, &[], 0, message_id).len() + 8;
    let step = if kind == b'F' { 7 } else { 5 };
    // Tables: 5 bytes for the innermost, 7 for every other level.
    let room = frame_max as usize - fixed;
    if kind == b'F' {
        (room - 5) / step + 1
    } else {
        room / step
    }
}

fn frame(kind: u8, channel: u16, payload: &[u8]) -> Vec<u8> {
    let mut f = vec![kind];
    f.extend_from_slice(&channel.to_be_bytes());
    f.extend_from_slice(&(payload.len() as u32).to_be_bytes());
    f.extend_from_slice(payload);
    f.push(FRAME_END);
    f
}

fn method(class: u16, id: u16, args: &[u8]) -> Vec<u8> {
    let mut p = class.to_be_bytes().to_vec();
    p.extend_from_slice(&id.to_be_bytes());
    p.extend_from_slice(args);
    p
}

fn short(s: &str) -> Vec<u8> {
    let mut v = vec![s.len() as u8];
    v.extend_from_slice(s.as_bytes());
    v
}

/// Reads one frame: type, channel, payload.
fn read_frame(s: &mut TcpStream) -> Result<(u8, u16, Vec<u8>), String> {
    let mut head = [0u8; 7];
    s.read_exact(&mut head)
        .map_err(|e| format!("reading a frame: {e}"))?;
    let size = u32::from_be_bytes([head[3], head[4], head[5], head[6]]) as usize;
    let mut rest = vec![0u8; size + 1];
    s.read_exact(&mut rest)
        .map_err(|e| format!("reading a frame: {e}"))?;
    rest.pop();
    Ok((head[0], u16::from_be_bytes([head[1], head[2]]), rest))
}

/// Reads frames until the method `class.id`; a `close` on the way is an error naming its text.
fn expect(s: &mut TcpStream, class: u16, id: u16) -> Result<Vec<u8>, String> {
    loop {
        let (kind, _, p) = read_frame(s)?;
        if kind != 1 || p.len() < 4 {
            continue;
        }
        let got = (
            u16::from_be_bytes([p[0], p[1]]),
            u16::from_be_bytes([p[2], p[3]]),
        );
        if got == (class, id) {
            return Ok(p);
        }
        if got == (10, 50) || got == (20, 40) {
            let text_len = p.get(6).copied().unwrap_or(0) as usize;
            let text = p.get(7..7 + text_len).unwrap_or_default();
            return Err(format!(
                "the broker closed: {}",
                String::from_utf8_lossy(text)
            ));
        }
    }
}

/// Publishes one message to `queue` through the default exchange, its header `h` set to the raw
/// field value `value`, with a publisher confirm; returns once the broker confirmed it.
pub fn publish(
    url: &str,
    queue: &str,
    value: &[u8],
    body: &[u8],
    message_id: &str,
) -> Result<Published, String> {
    let header = header_payload(value, body.len(), message_id);
    publish_raw(url, "", queue.as_bytes(), &header, body)
}

/// [`publish`] with the header named `key`: an `x-` header reaches an AMQP 1.0 consumer as a
/// message annotation, any other as an application property.
pub fn publish_named(
    url: &str,
    queue: &str,
    key: &str,
    value: &[u8],
    body: &[u8],
    message_id: &str,
) -> Result<Published, String> {
    let header = header_payload_named(key, value, body.len(), message_id);
    publish_raw(url, "", queue.as_bytes(), &header, body)
}

/// Content-header payload with a content type and a message id given as raw bytes (which need
/// not be UTF-8), and delivery mode 2; no headers.
pub fn raw_properties(body_len: usize, content_type: &[u8], message_id: &[u8]) -> Vec<u8> {
    let mut p = vec![0, 60, 0, 0];
    p.extend_from_slice(&(body_len as u64).to_be_bytes());
    p.extend_from_slice(&((1u16 << 15) | (1 << 12) | (1 << 7)).to_be_bytes());
    p.push(content_type.len() as u8);
    p.extend_from_slice(content_type);
    p.push(2);
    p.push(message_id.len() as u8);
    p.extend_from_slice(message_id);
    p
}

/// Publishes one message to `exchange` with a raw routing key (which need not be UTF-8) and a raw
/// content-header payload, with the mandatory flag and a publisher confirm; returns once the
/// broker confirmed it.
pub fn publish_raw(
    url: &str,
    exchange: &str,
    routing_key: &[u8],
    header_payload: &[u8],
    body: &[u8],
) -> Result<Published, String> {
    let uri: AMQPUri = url.parse().map_err(|e: String| e)?;
    let mut s = TcpStream::connect((uri.authority.host.as_str(), uri.authority.port))
        .map_err(|e| format!("connecting: {e}"))?;
    s.set_read_timeout(Some(Duration::from_secs(30)))
        .map_err(|e| e.to_string())?;
    let w = |s: &mut TcpStream, bytes: &[u8]| s.write_all(bytes).map_err(|e| e.to_string());
    w(&mut s, b"AMQP\x00\x00\x09\x01")?;
    expect(&mut s, 10, 10)?;
    let user = &uri.authority.userinfo;
    let mut start_ok = 0u32.to_be_bytes().to_vec();
    start_ok.extend(short("PLAIN"));
    let response = format!("\0{}\0{}", user.username, user.password);
    start_ok.extend_from_slice(&(response.len() as u32).to_be_bytes());
    start_ok.extend_from_slice(response.as_bytes());
    start_ok.extend(short("en_US"));
    w(&mut s, &frame(1, 0, &method(10, 11, &start_ok)))?;
    let tune = expect(&mut s, 10, 30)?;
    let frame_max = u32::from_be_bytes([tune[6], tune[7], tune[8], tune[9]]);
    let mut tune_ok = tune[4..6].to_vec();
    tune_ok.extend_from_slice(&frame_max.to_be_bytes());
    tune_ok.extend_from_slice(&0u16.to_be_bytes());
    w(&mut s, &frame(1, 0, &method(10, 31, &tune_ok)))?;
    let mut open = short(&uri.vhost);
    open.extend([0, 0]);
    w(&mut s, &frame(1, 0, &method(10, 40, &open)))?;
    expect(&mut s, 10, 41)?;
    w(&mut s, &frame(1, 1, &method(20, 10, &[0])))?;
    expect(&mut s, 20, 11)?;
    w(&mut s, &frame(1, 1, &method(85, 10, &[0])))?;
    expect(&mut s, 85, 11)?;
    let mut publish = vec![0, 0];
    publish.extend(short(exchange));
    publish.push(routing_key.len() as u8);
    publish.extend_from_slice(routing_key);
    publish.push(1); // mandatory
    let header = frame(2, 1, header_payload);
    let published = Published {
        frame_max,
        header_frame: header.len(),
    };
    let mut wire = frame(1, 1, &method(60, 40, &publish));
    wire.extend_from_slice(&header);
    wire.extend(frame(3, 1, body));
    w(&mut s, &wire)?;
    loop {
        let (kind, _, p) = read_frame(&mut s)?;
        if kind != 1 || p.len() < 4 {
            continue;
        }
        match (
            u16::from_be_bytes([p[0], p[1]]),
            u16::from_be_bytes([p[2], p[3]]),
        ) {
            (60, 80) => break,
            (60, 50) => {
                return Err(format!(
                    "returned: nothing bound to {}",
                    String::from_utf8_lossy(routing_key)
                ))
            }
            (60, 120) => return Err("nacked".into()),
            (10, 50) | (20, 40) => {
                let text_len = p.get(6).copied().unwrap_or(0) as usize;
                let text = p.get(7..7 + text_len).unwrap_or_default();
                return Err(format!(
                    "the broker closed: {}",
                    String::from_utf8_lossy(text)
                ));
            }
            _ => {}
        }
    }
    let mut close = 200u16.to_be_bytes().to_vec();
    close.extend(short("bye"));
    close.extend([0, 0, 0, 0]);
    w(&mut s, &frame(1, 0, &method(10, 50, &close)))?;
    let _ = expect(&mut s, 10, 51);
    Ok(published)
}
