"""Where a test run's CPU went: the lines tests/conftest.py appends to ``FCIR_TEST_CPU``
(CPU seconds, wall seconds, test id), summed per test file and shown per test.

    FCIR_TEST_CPU=cpu.tsv python -m pytest -n 4 --dist loadfile tests
    python tools/test_cpu.py cpu.tsv --top 20

CI (.ci/run) prints this for each leg: on two busy cores CI's time is the suite's CPU
seconds over two, so these are the figures to cut.
"""

from __future__ import annotations

import argparse
import collections
import sys


def read(path: str) -> list[tuple[float, float, str]]:
    rows = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            parts = line.rstrip("\n").split("\t")
            if len(parts) != 3:
                raise SystemExit(f"{path}:{n}: not 'cpu<TAB>wall<TAB>test id': {line!r}")
            rows.append((float(parts[0]), float(parts[1]), parts[2]))
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("file", help="the file FCIR_TEST_CPU named")
    ap.add_argument("--top", type=int, default=15, help="how many files and tests to list")
    a = ap.parse_args(argv)
    try:
        rows = read(a.file)
    except FileNotFoundError:
        print(f"{a.file}: no such file (was FCIR_TEST_CPU set for the run?)", file=sys.stderr)
        return 1
    total = sum(r[0] for r in rows)
    per_file = collections.Counter()
    for cpu, _, test in rows:
        per_file[test.split("::")[0]] += cpu
    print(
        f"{len(rows)} tests, {total:.0f} CPU s in all (their processes and the ones "
        "they waited for)"
    )
    print(f"files by CPU s (top {a.top}):")
    for name, cpu in per_file.most_common(a.top):
        print(f"  {cpu:8.1f}  {100 * cpu / max(total, 1e-9):4.1f}%  {name}")
    print(f"tests by CPU s (top {a.top}; wall s beside):")
    for cpu, wall, test in sorted(rows, reverse=True)[: a.top]:
        print(f"  {cpu:8.1f}  {wall:7.1f}  {test}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
