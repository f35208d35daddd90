#!/usr/bin/env python3
"""Writes the committed seed corpus (fuzz/corpus/<target>/): python3 seeds/make_seeds.py.

Frame-guard seeds are readable AMQP frame streams (byte 0: raw mode and the socket read size,
byte 1: the client's frame size; see fuzz_targets/frame_guard.rs). The other targets read
their input through `arbitrary`, so any bytes are an input: their seeds are a few fixed
pseudo-random blobs of different sizes, which the fuzzer grows from.
"""
import os
import random
import struct

HERE = os.path.dirname(os.path.abspath(__file__))
CORPUS = os.path.join(HERE, "..", "corpus")
END = b"\xce"
HEADERS_FLAG = 1 << 13


def frame(kind, channel, payload):
    return bytes([kind]) + struct.pack(">HI", channel, len(payload)) + payload + END


def tune(frame_max):
    return frame(1, 0, bytes([0, 10, 0, 30]) + struct.pack(">HIH", 2047, frame_max, 60))


def short(s):
    return bytes([len(s)]) + s


def long_str(s):
    return b"S" + struct.pack(">I", len(s)) + s


def entry(key, value):
    return short(key) + value


def container(tag, body):
    return tag + struct.pack(">I", len(body)) + body


def nested(kind, depth):
    """`depth` arrays (A), tables with one entry `k` (F) or both in turn (M)."""
    v = b"V"
    for i in range(depth):
        tag = kind if kind != "M" else ("F" if i % 2 else "A")
        v = container(b"A", v) if tag == "A" else container(b"F", entry(b"k", v))
    return v


def header(entries, content_type=b"json", extra_flags=0, after=b"\x02"):
    table = b"".join(entries)
    flags = (1 << 15) | HEADERS_FLAG | (1 << 12) | extra_flags
    payload = bytes([0, 60, 0, 0]) + struct.pack(">Q", 3) + struct.pack(">H", flags)
    payload += short(content_type) + struct.pack(">I", len(table)) + table + after
    return frame(2, 1, payload)


def deliver(exchange, routing_key):
    payload = bytes([0, 60, 0, 60]) + short(b"ctag") + struct.pack(">Q", 1) + b"\x00"
    payload += short(exchange) + short(routing_key)
    return frame(1, 1, payload)


def x_death():
    record = b"".join([
        entry(b"count", b"l" + struct.pack(">q", 3)),
        entry(b"queue", long_str(b"orders")),
        entry(b"reason", long_str(b"rejected")),
        entry(b"routing-keys", container(b"A", long_str(b"orders"))),
        entry(b"time", b"T" + struct.pack(">Q", 1_700_000_000)),
    ])
    return entry(b"x-death", container(b"A", container(b"F", record)))


def write(target, name, data):
    d = os.path.join(CORPUS, target)
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, name), "wb") as f:
        f.write(data)


def main():
    raw = lambda chunk, fm, stream: bytes([chunk, fm]) + stream  # noqa: E731
    body = frame(3, 1, b'{"id": 1}')
    ok = header([x_death(), entry(b"x-redeliver-attempt", b"l" + struct.pack(">q", 2))])
    write("frame_guard", "x-death", raw(6, 2, tune(131072) + deliver(b"", b"orders") + ok + body))
    # 2,000 nested arrays: what killed lapin's I/O thread, cut to the limit by the guard.
    write("frame_guard", "deep-arrays", raw(8, 2, tune(131072) + header([entry(b"h", nested("A", 2000))]) + body))
    write("frame_guard", "deep-mixed", raw(2, 0, header([entry(b"h", nested("M", 600)), entry(b"ok", b"t\x01")])))
    write("frame_guard", "at-the-limit", raw(0, 0, header([entry(b"h", nested("F", 32)), entry(b"i", nested("A", 33))])))
    write("frame_guard", "forged-marker", raw(3, 0, header([entry(b"x-redeliver-headers-removed", long_str(b"lies"))])))
    write("frame_guard", "malformed", raw(1, 0, header([entry(b"h", b"A" + struct.pack(">I", 1000))])
                                          + header([b"\x01\xff" + b"V"])))
    write("frame_guard", "not-utf8-routing-key", raw(4, 1, tune(4096) + deliver(b"ex\xff", b"rk\xc3") + header([], content_type=b"te\xffxt") + body))
    write("frame_guard", "too-large-for-frame", raw(9, 1, tune(4096) + header([entry(b"k%d" % i, b"t\x01") for i in range(1500)])))
    write("frame_guard", "protocol-header", raw(0, 0, b"AMQP\x00\x00\x09\x01"))
    # A frame type lapin does not know closes its connection there: what follows is not framed
    # (the guard passes it on, a 2,000-deep header included) and lapin never parses it.
    write("frame_guard", "unknown-frame-type", raw(8, 2, frame(7, 0, b"\x00\x0a\x00\x1e") + header([entry(b"h", nested("A", 2000))]) + body))
    rng = random.Random(29)
    for i, n in enumerate([64, 512, 4000]):
        write("frame_guard", "structured-%d" % i, bytes([0x80 | i, i]) + bytes(rng.randrange(256) for _ in range(n)))
    for target in ["headers", "cli_render", "url", "env"]:
        for i, n in enumerate([16, 128, 1024, 4000]):
            write(target, "blob-%d" % i, bytes(rng.randrange(256) for _ in range(n)))


if __name__ == "__main__":
    main()
