"""TensorBoard event files written directly (scalars only), without the tensorboard package.

The format is TFRecord: per record a little-endian uint64 length, its masked CRC-32C, the data
and the data's masked CRC-32C; each record's data is an ``Event`` protocol buffer, encoded here
by hand (wall_time = 1, step = 2, file_version = 3, summary = 5; Summary.value = 1;
Value.tag = 1, Value.simple_value = 2).
"""

from __future__ import annotations

import socket
import struct
import time
from pathlib import Path


def _crc32c_table() -> list[int]:
    table = []
    for byte in range(256):
        crc = byte
        for _ in range(8):
            crc = (crc >> 1) ^ 0x82F63B78 if crc & 1 else crc >> 1
        table.append(crc)
    return table


_TABLE = _crc32c_table()


def crc32c(data: bytes) -> int:
    crc = 0xFFFFFFFF
    for byte in data:
        crc = _TABLE[(crc ^ byte) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF


def _masked(crc: int) -> int:
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        low, value = value & 0x7F, value >> 7
        out.append(low | (0x80 if value else 0))
        if not value:
            return bytes(out)


def _field(number: int, payload: bytes) -> bytes:
    """A length-delimited protobuf field."""
    return _varint(number << 3 | 2) + _varint(len(payload)) + payload


def event(
    step: int, wall_time: float, scalars: dict[str, float] | None = None, version: str = ""
) -> bytes:
    data = b"\x09" + struct.pack("<d", wall_time) + b"\x10" + _varint(step)
    if version:
        data += _field(3, version.encode())
    if scalars:
        values = b"".join(
            _field(1, _field(1, tag.encode()) + b"\x15" + struct.pack("<f", value))
            for tag, value in scalars.items()
        )
        data += _field(5, values)
    return data


def record(data: bytes) -> bytes:
    length = struct.pack("<Q", len(data))
    return (
        length
        + struct.pack("<I", _masked(crc32c(length)))
        + data
        + struct.pack("<I", _masked(crc32c(data)))
    )


class EventWriter:
    """One ``events.out.tfevents.*`` file in ``log_dir``; ``add`` writes a step's scalars."""

    def __init__(self, log_dir: Path) -> None:
        log_dir.mkdir(parents=True, exist_ok=True)
        name = f"events.out.tfevents.{int(time.time())}.{socket.gethostname()}"
        self.path = log_dir / name
        self.path.write_bytes(record(event(0, time.time(), version="brain.Event:2")))

    def add(self, step: int, scalars: dict[str, float]) -> None:
        finite = {k: float(v) for k, v in scalars.items() if isinstance(v, int | float) and v == v}
        with self.path.open("ab") as out:
            out.write(record(event(step, time.time(), finite)))
