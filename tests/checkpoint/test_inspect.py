"""`fcir ckpt inspect`: layout table, integrity check, exit codes, no tracebacks."""

from __future__ import annotations

import argparse
import io
import json
import subprocess
import sys

import jax
import numpy as np
import pytest
from ckpt_testing import child_env, values
from fcir.checkpoint import inspect
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from fcir import checkpoint


@pytest.fixture
def saved(tmp_path, devices):
    mesh = jax.make_mesh((2, 4), ("a", "b"), devices=devices)
    checkpoint.save(
        tmp_path / "c",
        {
            "params": {
                "w": jax.device_put(values((64, 48), seed=1), NamedSharding(mesh, P("b", "a"))),
                "b": jax.device_put(values((48,), "bfloat16"), NamedSharding(mesh, P())),
            },
            "step": 3,
        },
    )
    return tmp_path / "c"


def run(capsys, *argv):
    code = inspect.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_prints_arrays_shapes_dtypes_shardings_bytes_and_integrity(saved, capsys):
    code, out, err = run(capsys, saved)
    assert code == 0 and err == ""
    assert "item params: 2 array(s)" in out
    row = next(line for line in out.splitlines() if line.strip().startswith("params/w"))
    assert row.split()[:3] == ["params/w", "float32", "[64,"]
    assert "mesh(a=2, b=4) spec('b', 'a')" in row and row.rstrip().endswith("12.0 KiB")
    assert "replicated on mesh(a=2, b=4)" in out and "bfloat16" in out
    assert "item step: JSON 3" in out
    assert "integrity: OK (1 file(s), 9 shard(s)" in out


def test_shards_lists_every_stored_block(saved, capsys):
    code, out, _ = run(capsys, saved, "--shards")
    assert code == 0 and "[0:16, 0:24] data-p00000.bin @" in out


def test_damage_fails_the_integrity_check_with_exit_1(saved, capsys):
    data = saved / "data-p00000.bin"
    shard = checkpoint.read_layout(saved).items[0].arrays.arrays[1].shards[3]  # params/w
    raw = bytearray(data.read_bytes())
    raw[shard.offset + 7] ^= 0xFF
    data.write_bytes(bytes(raw))
    code, out, _ = run(capsys, saved)
    assert code == 1
    assert "integrity: FAILED (1 problem(s))" in out and "'params/" in out and "checksum" in out
    assert run(capsys, saved, "--no-verify")[0] == 0


def test_truncation_is_reported(saved, capsys):
    data = saved / "data-p00000.bin"
    data.write_bytes(data.read_bytes()[:1000])
    code, out, _ = run(capsys, saved)
    assert code == 1 and "has 1000 bytes, the layout says" in out and "truncated" in out


def test_json_output(saved, capsys):
    code, out, _ = run(capsys, saved, "--json")
    doc = json.loads(out)
    assert code == 0 and doc["integrity"]["ok"] and doc["layout"]["layoutVersion"] == 1


def test_usage_errors_exit_2_without_traceback(tmp_path, capsys):
    assert run(capsys, "--bogus", tmp_path)[0] == 2
    code, _, err = run(capsys, tmp_path / "missing")
    assert code == 2 and "does not exist" in err and "Traceback" not in err
    assert run(capsys)[0] == 2


def test_a_directory_that_is_not_a_checkpoint_exits_1_with_one_line(tmp_path, capsys):
    code, _, err = run(capsys, tmp_path)
    assert code == 1 and err.count("\n") == 1 and "not a committed checkpoint" in err
    (tmp_path / "layout.pb").write_bytes(b"\x00garbage")
    code, _, err = run(capsys, tmp_path)
    assert code == 1 and "corrupt" in err and "Traceback" not in err


def test_debug_shows_the_traceback(tmp_path, capsys):
    code, _, err = run(capsys, tmp_path, "--debug")
    assert code == 1 and "Traceback" in err


def test_help_explains_the_command_and_exit_codes(capsys):
    code, out, _ = run(capsys, "--help")
    assert code == 0
    assert "usage: fcir ckpt inspect" in out and "checksum" in out and "exit status" in out


def test_mounts_as_a_subcommand_of_a_larger_cli(saved):
    parser = argparse.ArgumentParser(prog="fcir")
    parser.add_argument("--debug", action="store_true")
    ckpt = parser.add_subparsers(dest="command", required=True).add_parser("ckpt")
    sub = ckpt.add_subparsers(dest="ckpt_command", required=True)
    p = sub.add_parser("inspect", help=inspect.HELP, description=inspect.DESCRIPTION)
    inspect.add_arguments(p, debug_flag=False)
    p.set_defaults(func=inspect.run)
    args = parser.parse_args(["ckpt", "inspect", str(saved), "--no-verify"])
    out = io.StringIO()
    assert args.func(args, out) == 0 and "item params" in out.getvalue()


def test_runs_as_a_module(saved):
    done = subprocess.run(
        [sys.executable, "-m", "fcir.checkpoint.inspect", str(saved)],
        env=child_env(1),
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 0 and "integrity: OK" in done.stdout


def test_a_huge_checkpoint_is_verified_piece_by_piece(tmp_path, capsys):
    checkpoint.save(tmp_path / "c", {"x": np.ones(2**23, np.float32)})  # 32 MiB: 2 pieces
    code, out, _ = run(capsys, tmp_path / "c")
    assert code == 0 and "32.0 MiB verified" in out


def test_an_orbax_format_checkpoint_counts_its_chunk_files_and_shards_lists_one_per_line(
    tmp_path, devices, capsys
):
    mesh = jax.make_mesh((8,), ("x",), devices=devices)
    sharded = NamedSharding(mesh, P("x"))
    tree = {f"w{i}": jax.device_put(values((64, 4), seed=i), sharded) for i in range(6)}
    checkpoint.save(tmp_path / "c", {"default": tree}, format="orbax")
    names = [f.name for f in checkpoint.read_layout(tmp_path / "c").files]
    assert len(names) == 48  # one zarr chunk file per shard
    code, out, _ = run(capsys, tmp_path / "c")
    assert code == 0
    assert "  files: 48, 6.0 KiB in all (--shards lists each)\n" in out
    assert not any(name in out for name in names)
    # one short line each (the checkpoint's own path, as long as the temporary folder's, aside)
    assert max(len(line) for line in out.replace(str(tmp_path / "c"), "C").splitlines()) < 100
    code, out, _ = run(capsys, tmp_path / "c", "--shards")
    lines = out.splitlines()
    assert code == 0 and "  files: 48, 6.0 KiB in all" in lines
    for name in names:
        assert sum(line.split() == [name, "128", "B"] for line in lines) == 1, name


def test_a_few_data_files_are_listed_one_per_line(saved, capsys):
    code, out, _ = run(capsys, saved)
    lines = out.splitlines()
    listed = lines[lines.index("  files: 1, 12.1 KiB in all") + 1]
    assert code == 0 and listed.split() == ["data-p00000.bin", "12.1", "KiB"]
