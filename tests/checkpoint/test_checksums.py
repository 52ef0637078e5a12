"""Checkpoint checksums are zlib's CRC-32 (the layout format says so), whichever
implementation computes them, and the fast one is used when it is installed."""

from __future__ import annotations

import importlib.util
import zlib

import numpy as np
import pytest
from fcir.checkpoint import checksums


@pytest.mark.parametrize("length", [0, 1, 7, 4096, 100_003])
def test_crc32_is_zlibs(length):
    data = memoryview(np.random.default_rng(length).integers(0, 256, length, np.uint8))
    assert checksums.crc32(data) == zlib.crc32(data)
    assert checksums.crc32(data, 0xDEADBEEF) == zlib.crc32(data, 0xDEADBEEF)
    half = length // 2  # continuing from the CRC of a prefix gives the CRC of the whole
    assert checksums.crc32(data[half:], checksums.crc32(data[:half])) == zlib.crc32(data)
    chunk = 1000
    expected = [zlib.crc32(data[i : i + chunk]) for i in range(0, length, chunk)] or [0]
    assert checksums.chunk_crcs(data, chunk) == expected


def test_the_fast_crc_is_used_when_installed():
    if importlib.util.find_spec("isal") is None:
        pytest.skip("isal is not installed: checksums fall back to zlib")
    assert checksums._crc32 is not zlib.crc32
