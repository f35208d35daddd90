#!/usr/bin/env python3
"""Writes the committed seeds of the amqp1_guard target (fuzz/corpus/amqp1_guard/):
python3 seeds/amqp1_guard/make_seeds.py.

Byte 0: the socket read size; byte 1: odd to wrap the rest in transfer frames (bytes 2 and 3
split it into three frames of one delivery), even to feed it raw. See
fuzz_targets/amqp1_guard.rs.
"""
import os
import struct

HERE = os.path.dirname(os.path.abspath(__file__))
CORPUS = os.path.join(HERE, "..", "..", "corpus", "amqp1_guard")


def lst(items):
    body = b"".join(items)
    if len(body) + 1 <= 255:
        return bytes([0xC0, len(body) + 1, len(items)]) + body
    return b"\xd0" + struct.pack(">II", len(body) + 4, len(items)) + body


def mp(pairs):
    return b"\xc1" + lst([x for kv in pairs for x in kv])[1:]


def string(s):
    return bytes([0xA1, len(s)]) + s


def described(code, value):
    return bytes([0x00, 0x53, code]) + value


def lists(depth):
    v = b"\x40"
    for _ in range(depth):
        v = lst([v])
    return v


def message(body):
    return (described(0x70, lst([b"\x41"]))
            + described(0x72, mp([(b"\xa3\x07x-opt-a", string(b"b"))]))
            + described(0x74, mp([(string(b"k"), b"\x52\x03")]))
            + described(0x77, body))


def frame(kind, channel, body):
    return struct.pack(">IBBH", len(body) + 8, 2, kind, channel) + body


def write(name, data):
    os.makedirs(CORPUS, exist_ok=True)
    with open(os.path.join(CORPUS, name), "wb") as f:
        f.write(data)


write("wrapped-valid", bytes([6, 1, 80, 160]) + message(lists(10)))
write("wrapped-at-limit", bytes([3, 1, 40, 200]) + message(lists(31)))
write("wrapped-deep", bytes([0, 1, 60, 120]) + message(lists(300)))
deep_map = b"\x40"
for _ in range(100):
    deep_map = mp([(string(b"k"), deep_map)])
write("wrapped-deep-maps", bytes([7, 1, 10, 250]) + described(0x77, deep_map))
write("wrapped-described-chain", bytes([2, 1, 0, 255]) + bytes([0x00] * 200) + b"\x40")
write("wrapped-malformed", bytes([1, 1, 5, 9]) + described(0x77, bytes([0xC0, 3, 5, 0x40, 0x40, 0x40, 0x40])))
# x-opt-deaths as RabbitMQ 4.x writes it (an array8 of map32) and as an array32 of described
# maps: the guard passes them on as binaries, and the delivery decodes.
death = b"".join([b"\xa3\x05queue", string(b"orders"), b"\xa3\x06reason", b"\xa3\x07expired",
                  b"\xa3\x05count", b"\x53\x01"])
map32 = struct.pack(">II", len(death) + 4, 6) + death
array8 = bytes([0xE0, 2 + len(map32), 1, 0xD1]) + map32
described_maps = b"\x00\x53\x33\xc1" + lst([death])[1:] + lst([death])[1:]
array32 = b"\xf0" + struct.pack(">II", 4 + len(described_maps), 2) + described_maps
deaths = described(0x72, mp([(b"\xa3\x0cx-opt-deaths", array8), (b"\xa3\x01d", array32)]))
write("wrapped-x-opt-deaths", bytes([5, 1, 200, 250]) + deaths + described(0x77, string(b"body")))
# Raw: the opening of a connection (SASL header and frames, AMQP header, open, a transfer).
opening = (b"AMQP\x03\x01\x00\x00"
           + frame(1, 0, described(0x40, lst([b"\xe0\x02\x01\xa3"])))
           + frame(1, 0, described(0x44, lst([b"\x50\x00"])))
           + b"AMQP\x00\x01\x00\x00"
           + frame(0, 0, described(0x10, lst([string(b"rabbit")])))
           + frame(0, 0, b""))
transfer = described(0x14, lst([b"\x43", b"\x43", b"\xa0\x01\x00", b"\x43", b"\x42", b"\x42"]))
write("raw-connection", bytes([4, 0]) + opening + frame(0, 1, transfer + message(lists(40))))
