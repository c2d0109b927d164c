"""The scoring workers' wire format (``rl/reward_pool.py`` <-> ``rl/reward_worker.py``): an
8-byte big-endian length, then a pickle. Its own module so the pool, which rank 0 and the CLI
import, does not load the scorers (reasoning-gym, math-verify: seconds)."""

from __future__ import annotations

import pickle
import struct
from typing import Any, BinaryIO

HEADER = struct.Struct(">Q")


def write_frame(stream: BinaryIO, message: Any) -> None:
    data = pickle.dumps(message)
    stream.write(HEADER.pack(len(data)) + data)
    stream.flush()


def read_frame(stream: BinaryIO) -> Any | None:
    """The next frame, or None at the end of the stream (the pool closed it)."""
    header = stream.read(HEADER.size)
    if len(header) < HEADER.size:
        return None
    return pickle.loads(stream.read(HEADER.unpack(header)[0]))
