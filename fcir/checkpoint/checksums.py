"""Chunked CRC-32 of shard bytes, so any chunk-aligned part of a shard verifies alone."""

from __future__ import annotations

import zlib

#: Shard bytes are checksummed in pieces of this size (the last piece may be shorter).
#: Small enough that a partial read rarely reads much it does not need, large enough
#: that the layout stays small (4 bytes per MiB).
CHUNK_BYTES = 1 << 20


def chunk_count(length: int, chunk_bytes: int) -> int:
    """How many checksums a block of `length` bytes has (an empty block has one)."""
    return max(1, -(-length // chunk_bytes))


def chunk_crcs(data: memoryview, chunk_bytes: int) -> list[int]:
    """The CRC-32 of each `chunk_bytes` piece of `data`; [crc32(b"")] when empty."""
    if len(data) == 0:
        return [0]
    return [zlib.crc32(data[i : i + chunk_bytes]) for i in range(0, len(data), chunk_bytes)]


def crc32(data: memoryview | bytes, value: int = 0) -> int:
    """zlib's CRC-32 of `data`, continuing from `value` (the CRC of what came before)."""
    return zlib.crc32(data, value)
