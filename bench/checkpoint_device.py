"""Checkpoints from device memory: fcir.checkpoint against Orbax on an accelerator.

    python bench/checkpoint_device.py           # the 368M model + its Adam state in device memory
    python bench/checkpoint_device.py --smoke   # a tiny model, one repetition (CI's smoke run)

The state is bench/fax_round.py's model (``scale.FAX_350M``: 368M float32 parameters)
and ``optax.adam``'s state for it (mu, nu, count), built on the default device and
trained one step, so that every array holds other bytes than its initial value. Each
repetition, after an untimed warm-up one, runs back to back, rotating which goes first:

- **save until committed**: ``fcir.checkpoint.save`` (blocking); Orbax 0.12's
  ``StandardCheckpointer().save`` followed by ``wait_until_finished()``; with
  ``--serial`` (and in ``--smoke``) also fcir with every device-to-host copy awaited
  before its first write (``fcir-serial``: how fcir saved before its writes overlapped
  the transfers). Each saves a fresh copy of the state in new device buffers: jax
  keeps an array's host copy once it has made one, so a second save of the same
  arrays would find its bytes on the host already;
- **restore**: fcir and Orbax each restore their own checkpoint onto the state's
  shardings (its ``ShapeDtypeStruct``s), cold: the checkpoint's files are synced and
  dropped from the page cache first (fcir's save writes past it, Orbax's through it).
  Each restored state is compared with the saved one bit for bit on the device; a
  difference stops the run;
- **a training step with an asynchronous save in flight**: the model's Adam step (its
  arguments donated); after one step, ``save(..., blocking=False)`` of its result,
  then steps timed one by one (each step's loss awaited) until the save is committed,
  against as many steps without a save (40 at most).

Every timed save and restore starts on a quiet disk (an untimed ``os.sync()`` before
and after it, and after each save an untimed fsync of every file it wrote). Printed:
each figure's seconds, median [min, max] over the repetitions, and ratios taken within
each repetition, median [min, max]; fcir's save split into phases. JSON with every
sample in
bench/results/checkpoint_device[-smoke]-<time>.json. Checkpoints go to a temporary
folder under ``--dir`` (default: the system's temporary folder), removed at the end.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import pathlib
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import _record  # bench/, the script's own folder
import _timing
import scale

REPO = scale.ROOT
SMOKE_BATCH, BATCH = 2, 8  # sequences per training step
WITHOUT_STEPS = 40  # at most: steps timed without a save, against those during one


# --- the state ---------------------------------------------------------------------------


def build_state(model: dict, batch: int, seed: int = 0):  # type: ignore[no-untyped-def]
    """The model's parameters and Adam state on the default device after one training
    step, the jitted step (arguments donated) and its tokens. Drawn with numpy and put
    on the device: the only program compiled is the step."""
    import jax
    import numpy as np
    import optax
    from corpus import transformer

    rng = np.random.default_rng(seed)

    def draw(path, s):  # type: ignore[no-untyped-def]
        if "scale" in jax.tree_util.keystr(path):
            return jax.device_put(np.ones(s.shape, s.dtype))
        return jax.device_put(rng.standard_normal(s.shape, np.float32) * np.float32(0.02))

    params = jax.tree_util.tree_map_with_path(draw, scale.param_specs(model))
    opt = optax.adam(1e-4)
    zeros = jax.tree.map(lambda s: jax.device_put(np.zeros(s.shape, s.dtype)),
                         jax.eval_shape(opt.init, params))  # fmt: skip

    def step(params, opt_state, tokens):  # type: ignore[no-untyped-def]
        loss, grads = jax.value_and_grad(transformer.loss_fn)(params, tokens, model["heads"])
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    train = jax.jit(step, donate_argnums=(0, 1))
    tokens = jax.device_put(rng.integers(0, model["vocab"], (batch, model["seq"] + 1), np.int32))
    params, opt_state, loss = train(params, zeros, tokens)
    jax.block_until_ready(loss)
    return {"params": params, "opt_state": opt_state}, train, tokens


def fresh_copy(tree):  # type: ignore[no-untyped-def]
    """A copy of `tree` in new device buffers, bit for bit, with no host copy yet."""
    import jax

    out = jax.tree.map(lambda x: jax.device_put(x, x.sharding, may_alias=False), tree)
    return jax.block_until_ready(out)


def abstract(tree):  # type: ignore[no-untyped-def]
    import jax

    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree)


def nbytes(tree) -> int:  # type: ignore[no-untyped-def]
    import jax

    return sum(x.nbytes for x in jax.tree.leaves(tree))


def make_bitwise_equal():  # type: ignore[no-untyped-def]
    """A jitted check that two trees of arrays hold the same bits (on their device)."""
    import jax
    import jax.numpy as jnp

    unsigned = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}

    def bits(x):  # type: ignore[no-untyped-def]
        return jax.lax.bitcast_convert_type(x, unsigned[x.dtype.itemsize])

    @jax.jit
    def equal(a, b):  # type: ignore[no-untyped-def]
        la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
        same = [jnp.array_equal(bits(x), bits(y)) for x, y in zip(la, lb)]
        return jnp.all(jnp.stack(same)) & (len(la) == len(lb))

    return lambda a, b: bool(equal(a, b))


# --- saves and restores ------------------------------------------------------------------


timed = _timing.synced


def settle(directory: pathlib.Path) -> float:
    """fsyncs every file under `directory` (outside the caller's figure), so that no save
    leaves unwritten data for the next where os.sync() may not reach the disk (a gVisor
    sandbox's 9p file system, where a save that followed another was up to 6x slower).
    Returns its seconds: the writeback a save left behind (none after fcir's)."""
    start = time.perf_counter()
    for root, _, names in os.walk(directory):
        for name in names:
            fd = os.open(os.path.join(root, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
    return time.perf_counter() - start


def drop_page_cache(directory: pathlib.Path) -> None:
    """Evicts the (synced, so clean) files under `directory` from the page cache."""
    for root, _, names in os.walk(directory):
        for name in names:
            fd = os.open(os.path.join(root, name), os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


@contextlib.contextmanager
def save_phases(into: dict[str, float], serial: bool):  # type: ignore[no-untyped-def]
    """Where a blocking fcir save's time goes: `host_copy` (checks, and starting the
    device-to-host copies), `write` (the data file's writes and checksums, and waiting
    for the copies as they arrive), `rest` (computed by the caller: the data file's
    fsync, the layout, the commit). With `serial`, the save first waits for every host
    copy (in `host_copy`), then writes."""
    from fcir.checkpoint import saving, writer

    real_take, real_write = saving.snapshot.take, writer.write_data_file

    def take(*a, **k):  # type: ignore[no-untyped-def]
        t = time.perf_counter()
        try:
            snap = real_take(*a, **k)
            if serial:
                snap.wait_host()
            return snap
        finally:
            into["host_copy"] = time.perf_counter() - t

    def write(*a, **k):  # type: ignore[no-untyped-def]
        t = time.perf_counter()
        try:
            return real_write(*a, **k)
        finally:
            into["write"] = time.perf_counter() - t

    saving.snapshot.take, writer.write_data_file = take, write
    try:
        yield
    finally:
        saving.snapshot.take, writer.write_data_file = real_take, real_write


def fcir_save(path: pathlib.Path, state: Any, serial: bool = False) -> dict[str, float]:
    from fcir import checkpoint

    name = "fcir_serial_save" if serial else "fcir_save"
    tree = fresh_copy(state)
    phases: dict[str, float] = {}

    def run() -> None:
        with save_phases(phases, serial):
            checkpoint.save(path, tree)

    total = timed(run)
    phases["rest"] = total - phases["host_copy"] - phases["write"]
    phases["settle"] = settle(path)
    return {name: total, **{f"{name}_{k}": v for k, v in phases.items()}}


def orbax_save(ckptr: Any, path: pathlib.Path, state: Any) -> dict[str, float]:
    tree = fresh_copy(state)
    returned: list[float] = []

    def run() -> None:
        start = time.perf_counter()
        ckptr.save(path, tree)
        returned.append(time.perf_counter() - start)  # Orbax's blocking part
        ckptr.wait_until_finished()

    total = timed(run)
    return {
        "orbax_save": total,
        "orbax_save_blocking": returned[0],
        "orbax_save_settle": settle(path),
    }


def restore_and_check(
    name: str, restore: Callable[[], Any], directory: pathlib.Path, tree: Any, equal: Any
) -> float:
    """Seconds of a cold restore (until its arrays are ready); checks it bit for bit."""
    import jax

    os.sync()
    drop_page_cache(directory)
    out: list[Any] = []
    seconds = timed(lambda: out.append(jax.block_until_ready(restore())))
    if not equal(out[0], tree):
        raise SystemExit(f"{name}'s restore differs from the saved state")
    return seconds


# --- a training step while an asynchronous save is in flight -----------------------------


def steps_with_async_save(
    path: pathlib.Path, state: dict, train: Any, tokens: Any
) -> tuple[dict, dict[str, Any]]:
    """One training step, an asynchronous save of its result (as a training loop
    saves), then steps one by one (each step's loss awaited) until the save is
    committed; then as many steps without a save (WITHOUT_STEPS at most). Returns the
    state and the timings."""
    import jax

    from fcir import checkpoint

    params, opt_state, loss = train(state["params"], state["opt_state"], tokens)
    jax.block_until_ready(loss)
    os.sync()
    start = time.perf_counter()
    handle = checkpoint.save(path, {"params": params, "opt_state": opt_state}, blocking=False)
    blocking = time.perf_counter() - start
    during = []
    while not handle.done() or not during:
        t = time.perf_counter()
        params, opt_state, loss = train(params, opt_state, tokens)
        jax.block_until_ready(loss)
        during.append(time.perf_counter() - t)
    handle.wait()
    whole = time.perf_counter() - start
    os.sync()
    without = []
    for _ in during[:WITHOUT_STEPS]:
        t = time.perf_counter()
        params, opt_state, loss = train(params, opt_state, tokens)
        jax.block_until_ready(loss)
        without.append(time.perf_counter() - t)
    times = {"blocking": blocking, "whole": whole, "steps_during": during, "steps_without": without}
    return {"params": params, "opt_state": opt_state}, times


# --- the run -----------------------------------------------------------------------------


def fmt(xs: list[float]) -> str:
    return f"{statistics.median(xs):.3f} [{min(xs):.3f}, {max(xs):.3f}]"


def repetition(
    r: int, work: pathlib.Path, run: dict, state: dict, ckptr: Any, serial: bool
) -> tuple[dict, dict[str, float]]:
    """One repetition: the saves, the restores, the async save under training."""
    from fcir import checkpoint

    samples: dict[str, float] = {}
    dirs = {n: work / f"{n}-{r}" for n in ("fcir", "orbax", "fcir-serial", "async")}
    saves = {
        "fcir": lambda: fcir_save(dirs["fcir"], state),
        "orbax": lambda: orbax_save(ckptr, dirs["orbax"], state),
    }
    if serial:
        saves["fcir-serial"] = lambda: fcir_save(dirs["fcir-serial"], state, serial=True)
    for name in _timing.rotated(list(saves), r):
        samples.update(saves[name]())
    target = abstract(state)
    restores = {
        "fcir": lambda: checkpoint.restore(dirs["fcir"], target),
        "orbax": lambda: ckptr.restore(dirs["orbax"], target),
    }
    for name in _timing.rotated(list(restores), r):
        seconds = restore_and_check(name, restores[name], dirs[name], state, run["equal"])
        samples[f"{name}_restore"] = seconds
    state, times = steps_with_async_save(dirs["async"], state, run["train"], run["tokens"])
    for d in dirs.values():
        shutil.rmtree(d, ignore_errors=True)
    samples["async_blocking"], samples["async_whole"] = times["blocking"], times["whole"]
    samples["step_during"] = statistics.mean(times["steps_during"])
    samples["step_without"] = statistics.mean(times["steps_without"])
    samples["steps"] = len(times["steps_during"])
    return state, samples


def report(samples: dict[str, list[float]]) -> dict[str, dict]:
    """Prints the tables; returns each ratio's per-repetition values and summary."""
    print(f"\n{'seconds, median [min, max]':<44} {'fcir':>24} {'orbax':>24}")
    for label, f, o in (
        ("save until committed", "fcir_save", "orbax_save"),
        ("untimed fsync of its files after the save", "fcir_save_settle", "orbax_save_settle"),
        ("cold restore, bit-exact", "fcir_restore", "orbax_restore"),
        ("async save: blocking part", "async_blocking", "orbax_save_blocking"),
    ):
        print(f"{label:<44} {fmt(samples[f]):>24} {fmt(samples[o]):>24}")
    rows = [
        ("async save: until committed", "async_whole"),
        ("training step, async save in flight", "step_during"),
        ("training step, no save", "step_without"),
        *((f"fcir save phase: {k}", f"fcir_save_{k}") for k in ("host_copy", "write", "rest")),
    ]
    figures = {
        "save until committed: orbax / fcir (goal >= 1)": ("orbax_save", "fcir_save"),
        "cold restore: orbax / fcir (goal >= 1)": ("orbax_restore", "fcir_restore"),
        "training step, async save in flight / none (goal <= 1.1)": (
            "step_during",
            "step_without",
        ),
        "async save: blocking part, orbax / fcir": ("orbax_save_blocking", "async_blocking"),
    }
    if "fcir_serial_save" in samples:
        rows.append(("save, host copies first (fcir-serial)", "fcir_serial_save"))
        rows += [
            (f"fcir-serial phase: {k}", f"fcir_serial_save_{k}") for k in ("host_copy", "write")
        ]
        figures["save: fcir-serial / fcir"] = ("fcir_serial_save", "fcir_save")
    for label, f in rows:
        print(f"{label:<44} {fmt(samples[f]):>24}")
    out = {k: _timing.ratio_stats(samples[a], samples[b]) for k, (a, b) in figures.items()}
    print("\nratio, median [min, max] of the repetitions")
    for label, st in out.items():
        print(f"{label:<60} {_timing.format_ratio(st)}")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="tiny model, one repetition")
    ap.add_argument("--reps", type=int, default=3, help="timed repetitions (after a warm-up)")
    ap.add_argument("--d", type=int, help="model width (default: the 368M model's, 1024)")
    ap.add_argument("--layers", type=int, help="model depth (default: the 368M model's, 24)")
    ap.add_argument("--batch", type=int, help=f"sequences per training step (default {BATCH})")
    ap.add_argument("--dir", default=tempfile.gettempdir(), help="where checkpoints go (made if missing)")
    ap.add_argument("--serial", action="store_true",
                    help="also fcir-serial: every host copy awaited before the first write")  # fmt: skip
    ap.add_argument("--out-dir", default=str(REPO / "bench" / "results"))
    a = ap.parse_args(argv)
    # Made (with its parents) before the 4 GiB state is built, not found missing after.
    pathlib.Path(a.dir).mkdir(parents=True, exist_ok=True)
    import jax
    import orbax.checkpoint as ocp

    model = dict(scale.SMOKE_MODEL if a.smoke else scale.FAX_350M)
    if a.d:
        model.update(d=a.d, ff=4 * a.d)
    if a.layers:
        model.update(layers=a.layers)
    reps = 1 if a.smoke else a.reps
    t = time.perf_counter()
    state, train, tokens = build_state(model, a.batch or (SMOKE_BATCH if a.smoke else BATCH))
    size, device = nbytes(state), jax.devices()[0]
    print(f"{scale.num_params(model) / 1e6:.1f}M parameters + Adam state: {size / 2**30:.2f} GiB "
          f"on {device.device_kind} ({device.platform}), built in {time.perf_counter() - t:.1f} s; "
          f"checkpoints in {a.dir}", flush=True)  # fmt: skip
    ckptr = ocp.StandardCheckpointer()
    run = {"train": train, "tokens": tokens, "equal": make_bitwise_equal()}
    samples: dict[str, list[float]] = {}
    work = pathlib.Path(tempfile.mkdtemp(prefix="fcir-ckpt-device-", dir=a.dir))
    try:
        for r in range(1 + reps):
            t = time.perf_counter()
            state, got = repetition(r, work, run, state, ckptr, a.serial or a.smoke)
            print(f"repetition {r}{' (warm-up)' if r == 0 else ''}: {time.perf_counter() - t:.1f} s: "
                  + ", ".join(f"{k} {v:.3f}" for k, v in got.items()), flush=True)  # fmt: skip
            if r > 0:
                for k, v in got.items():
                    samples.setdefault(k, []).append(v)
    finally:
        ckptr.close()
        shutil.rmtree(work, ignore_errors=True)
    figures = report(samples)
    _record.write(a.out_dir, "checkpoint_device", {
        "smoke": a.smoke, "model": model, "params": scale.num_params(model), "state_bytes": size,
        "device": device.device_kind, "platform": device.platform, "dir": a.dir, "reps": reps,
        "samples_s": samples, "figures": figures,
        "versions": _record.versions("orbax-checkpoint", "optax"), **_record.machine(),
    }, "smoke" if a.smoke else None)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
