"""How fast fcir's data-file writer is with fewer or more threads and other piece sizes,
side by side with `dd` writing the same bytes.

    python bench/checkpoint_writes.py --size-mib 256 1024 --reps 5

Each repetition writes, in a rotated order, the same 32 blocks (a 4-leaf tree over 8
devices, as bench/checkpoint.py saves) with `writer.write_data_file` for every
(threads, piece size) pair, and `dd bs=1M conv=fdatasync` of as many bytes; each timed
call ends with its data on disk (fsync), starts after `--settle` s of rest and an
untimed os.sync(), and is followed by one. Prints per configuration the median, min and
max seconds and the ratio to dd within each repetition (median (min..max)).
"""

from __future__ import annotations

import argparse
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

REPO = pathlib.Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import _timing  # noqa: E402  (bench/, the script's own folder)
from fcir.checkpoint import checksums, parallel, writer  # noqa: E402


def blocks_of(total_mib: float) -> list[np.ndarray]:
    n = int(total_mib * 2**20) // 32 // 4
    rng = np.random.default_rng(0)
    return [rng.random(n, dtype=np.float32) for _ in range(32)]


def fcir_write(path: pathlib.Path, blocks: list[np.ndarray], threads: int, piece: int) -> None:
    saved = writer.PIECE_BYTES
    writer.PIECE_BYTES = piece
    try:
        writer.write_data_file(path, blocks, threads=threads)
    finally:
        writer.PIECE_BYTES = saved


def dd(path: pathlib.Path, nbytes: int) -> None:
    count = -(-nbytes // 2**20)
    cmd = ["dd", "if=/dev/zero", f"of={path}", "bs=1M", f"count={count}", "conv=fdatasync"]
    subprocess.run(cmd, check=True, capture_output=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mib", type=float, nargs="+", default=[256.0])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2, parallel.THREADS])
    parser.add_argument("--piece-mib", type=int, nargs="+", default=[4, 16, 64])
    parser.add_argument("--settle", type=float, default=1.0)
    parser.add_argument("--dir", default=None)
    args = parser.parse_args()
    work = pathlib.Path(args.dir or tempfile.mkdtemp(prefix="fcir-writes-"))
    work.mkdir(parents=True, exist_ok=True)
    for size in args.size_mib:
        blocks = blocks_of(size)
        nbytes = sum(b.nbytes for b in blocks)
        configs = [
            (f"fcir threads={t} piece={p}MiB", t, p * 2**20)
            for t in args.threads
            for p in args.piece_mib
            if p * 2**20 % checksums.CHUNK_BYTES == 0
        ]
        names = ["dd", *(c[0] for c in configs)]
        samples: dict[str, list[float]] = {n: [] for n in names}
        path = work / "data.bin"
        for rep in range(args.reps + 1):  # the first is a warm-up
            order = names[rep % len(names) :] + names[: rep % len(names)]
            for name in order:
                time.sleep(args.settle)
                if name == "dd":
                    t = _timing.synced(lambda: dd(path, nbytes))
                else:
                    _, threads, piece = next(c for c in configs if c[0] == name)
                    t = _timing.synced(lambda: fcir_write(path, blocks, threads, piece))
                path.unlink()
                if rep:
                    samples[name].append(t)
        print(f"\n{nbytes / 2**20:.0f} MiB, {args.reps} reps, load {os.getloadavg()}")
        print(f"{'':<28} {'median s':>9} {'min..max s':>15}   / dd per rep: median (min..max)")
        for name in names:
            xs = samples[name]
            ratios = [x / d for x, d in zip(xs, samples["dd"])]
            print(
                f"{name:<28} {statistics.median(xs):>9.3f} {min(xs):>7.3f}..{max(xs):<7.3f}"
                f"   {statistics.median(ratios):.2f} ({min(ratios):.2f}..{max(ratios):.2f})"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
