"""``xla.simulate``: many rounds of a federated program over a population's cohorts.

```python
import jax, jax.numpy as jnp, numpy as np
import fcir
from fcir.interpreters import xla

rng = np.random.default_rng(0)
clients = [(rng.normal(size=(n, 3)).astype(np.float32),) for n in rng.integers(2, 9, 200)]
cohorts = fcir.Population.from_clients(clients).uniform(20, seed=0)  # 200 clients, 20 a round

def client_mean(w, x, n):            # one client: the mean of its n real rows
    mask = (jnp.arange(x.shape[0]) < n)[:, None]
    return jnp.sum(x * mask, 0) / jnp.maximum(n, 1.0) - w

@fcir.program(placements={"clients": cohorts.size})
def fedavg_round(w, data, counts):    # (state, the cohort's data, its example counts)
    deltas = fcir.map_fn(client_mean, (fcir.broadcast(w), *data, counts))
    return w + 0.5 * fcir.reduce_weighted_mean(deltas, counts)

w, _ = xla.simulate(fedavg_round, jnp.zeros(3), cohorts, rounds=10)
```

``simulate(round_fn, state, cohorts, rounds)`` runs ``state = round_fn(state, data,
counts)`` for rounds ``first_round, first_round + 1, ...``, where ``(data, counts)`` is
that round's cohort (``cohorts.gather(r)``: the same members, padding and order; a
padding member has zero data and count 0, so the program masks it by its count). With
``key=`` the round also gets ``jax.random.fold_in(key, r)`` as a fourth argument (for
``fcir.dp_mean``'s noise). ``round_fn`` may return the new state, or ``(state,
metrics)``: the metrics of every round come back stacked on a leading axis (else None).

``round_fn`` is an ``@fcir.program`` function whose placement has ``cohorts.size``
members (captured here, with ``fcir.capture``, and compiled with ``xla.compile(module,
mesh, clients_per_step, members=members)``, once per cohort shape and kept for later
calls while the function lives, as ``jax.jit`` keeps its traces), or an ``fcir.Module``
of that signature, or an ``xla.compile``'d Executable. Cohorts padded round by round
(``padding="bucket"``) have a shape per example length: the round must then be the
function (compiled for each length that occurs, before the first round), and the
rounds run in the host loop. ``members="auto"`` (the default here; ``xla.compile``'s
is ``"vmap"``) runs the members one after another on CPU when a convolution is inside
their ``fed.map`` (``fcir.interpreters.xla.members``: XLA:CPU runs convolutions inside
loops and vmapped ones slowly), else all at once.

Two loops, one result (the same cohorts and keys; ``loop=`` picks, ``"auto"`` by
device and size):

- ``"device"``: the population is put on the device (on a mesh, replicated on each of
  its devices), where it stays for the next call on it (one population at a time: a
  population is read-only, ``fcir.Population``), and all the rounds run in one compiled
  ``lax.scan``; each step gathers its cohort on the device from the cohorts' indices,
  sampled beforehand on the host. One dispatch for the whole run. A ragged population
  stays ragged there (its examples concatenated; a member is a window of examples,
  zeroed past its count).
  ``"auto"`` picks it on an accelerator when the population takes at most a quarter
  of the device's memory and fits beside the round's peak (XLA's memory analysis; a
  round of ``clients_per_step="auto"`` may fill the memory), there is no mesh, no
  callback and one cohort shape: there it saves each round's host gather and
  transfer, which the host loop waits for whenever a round is shorter than them, and
  which cost it a little even where a round is longer (bench/README.md, TPU v5e: CIFAR
  cohort 50 of 1,000, a 42.8 ms round against 28 ms of gather and transfer: the
  device loop 1.000 of the compiled round called back to back, the host loop 1.056).
  On CPU, where the device's memory is the host's, it would gather each cohort between
  the rounds, where the host loop gathers it in a thread of its own while the round
  runs: ``"auto"`` picks the host loop (bench/simulate.py's CIFAR round, cohort 50 of
  1,000, 2 cores at load 5, one repetition each: 0.099 rounds/s in the device loop,
  0.125 in the host loop).
- ``"host"``: the population stays in host memory. A thread gathers each round's cohort
  on the host and puts it on the devices ahead of the rounds, and each round is
  dispatched before the one ahead of it has finished, then that one is waited for:
  neither the gather, the transfer nor a wait leaves the device idle, and at most three
  cohorts exist at once (the running round's, the queued round's, the one being put),
  in host arrays reused round after round (for bucketed cohorts, one buffer a leaf
  viewed at each round's length, as large as the longest needs). On an accelerator the
  cohorts ahead of the running round are as many as its memory holds beside the
  round's peak (XLA's memory analysis; ``clients_per_step="auto"`` may fill the
  memory): two, one, or none, when the next cohort is put once a round has finished.
  ``callback(r, state, metrics)`` is called after each round has finished (host loop
  only), while the next round runs.

The host loop computes each round with the compiled round itself, so its result is
bitwise that of calling ``exe(state, *cohorts.gather(r))`` round by round; the device
loop compiles the rounds into one program, which XLA may fuse differently (the same to
float rounding, usually bitwise on CPU).
"""

from __future__ import annotations

import math
import queue
import threading
import weakref
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from fcir.errors import PopulationError
from fcir.frontend.capture import capture
from fcir.ir import Module
from fcir.population import Cohorts

from .build import compile as xla_compile
from .cost import predicted_peak
from .executable import Executable, _mesh_context
from .memory_budget import allocator_limit

__all__ = ["device_budget", "simulate"]

LOOPS = ("auto", "device", "host")


def device_budget(device=None) -> int:
    """Bytes of population that ``loop="auto"`` puts on ``device``: a quarter of its
    memory, or 1 GiB where JAX reports none (CPU)."""
    limit = allocator_limit(device or jax.devices()[0])
    return limit // 4 if limit else 2**30


def _on_accelerator() -> bool:
    """Whether JAX's default device is an accelerator (not the host's CPU)."""
    return jax.devices()[0].platform != "cpu"


def simulate(
    round_fn,
    state,
    cohorts: Cohorts,
    rounds: int,
    *,
    key=None,
    first_round: int = 0,
    loop: str = "auto",
    mesh=None,
    clients_per_step=None,
    members: str = "auto",
    callback: Callable | None = None,
):
    """``rounds`` rounds of ``round_fn`` over ``cohorts``; returns ``(state, metrics)``
    (metrics stacked per round, or None). See the module docstring."""
    _check_arguments(cohorts, rounds, first_round, loop, callback)
    rounds, first_round = int(rounds), int(first_round)
    if cohorts.bucketed:
        _check_bucketed(round_fn, loop)
        plan = cohorts.plan(first_round, rounds)
        lengths = sorted({cohorts._length(i, v) for i, v in zip(*plan)})  # noqa: SLF001
    else:
        plan, lengths = None, [cohorts._round_length(None, "specs")]  # noqa: SLF001
    exes = {
        n: _executable(round_fn, state, cohorts, n, key, first_round, mesh,
                       clients_per_step, members)
        for n in lengths
    }  # fmt: skip
    has_metrics = _has_metrics(exes, state, cohorts, key, first_round)
    if rounds == 0:
        return state, None
    if loop == "auto":
        fits = _on_accelerator() and cohorts.population.nbytes <= device_budget()
        device = fits and callback is None and mesh is None and not cohorts.bucketed
        if device:  # and the population beside the round's peak
            (exe,) = exes.values()
            peak = _peak(exe, state, cohorts._specs(lengths[0]), key, first_round)  # noqa: SLF001
            limit = _device_limit(exes)
            device = limit is None or cohorts.population.nbytes + peak <= limit
        loop = "device" if device else "host"
    if loop == "device":
        (exe,) = exes.values()
        return _device_loop(exe, state, cohorts, rounds, key, first_round, has_metrics)
    return _host_loop(exes, state, cohorts, rounds, key, first_round, has_metrics, callback,
                      plan)  # fmt: skip


def _check_arguments(cohorts, rounds, first_round, loop, callback) -> None:
    if not isinstance(cohorts, Cohorts):
        raise PopulationError(
            f"xla.simulate: cohorts must be fcir.Cohorts (Population.uniform / .poisson), "
            f"got {type(cohorts).__name__}"
        )
    if isinstance(rounds, bool) or not isinstance(rounds, (int, np.integer)) or rounds < 0:
        raise PopulationError(f"xla.simulate: rounds must be an int >= 0, got {rounds!r}")
    if (
        isinstance(first_round, bool)
        or not isinstance(first_round, (int, np.integer))
        or (first_round < 0)
    ):
        raise PopulationError(f"xla.simulate: first_round must be an int >= 0, got {first_round!r}")
    if loop not in LOOPS:
        raise PopulationError(f"xla.simulate: loop must be one of {LOOPS}, got {loop!r}")
    if callback is not None and loop == "device":
        raise PopulationError(
            "xla.simulate: callback runs after each round of the host loop; the device "
            "loop runs all rounds in one program: pass loop='host' (or no callback)"
        )


def _check_bucketed(round_fn, loop: str) -> None:
    """Bucketed cohorts have a shape per example length: the round is compiled once per
    length, so it must be a function, and the rounds run in the host loop."""
    if isinstance(round_fn, (Module, Executable)):
        what = "an fcir.Module" if isinstance(round_fn, Module) else "an xla Executable"
        raise PopulationError(
            f"xla.simulate: round_fn is {what}, of one fixed cohort shape, but these "
            "cohorts are padded round by round (a shape per example length): pass the "
            "@fcir.program function itself (captured and compiled once per length), or "
            "sample the cohorts with padding='population' (one shape)"
        )
    if loop == "device":
        raise PopulationError(
            "xla.simulate: the device loop runs every round in one compiled program of one "
            "cohort shape, but these cohorts are padded round by round: pass loop='host' "
            "(or 'auto'), or sample the cohorts with padding='population'"
        )


# -- the round --------------------------------------------------------------------------


def _round_key(key, r):
    return jax.random.fold_in(key, r)


def _args(state, cohort, key, r):
    data, counts = cohort
    return (state, data, counts) if key is None else (state, data, counts, _round_key(key, r))


# Rounds given as functions, captured and compiled: per function (weakly, as jax.jit
# caches a function's traces), per argument types, cohort size and compile options.
_COMPILED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _executable(
    round_fn, state, cohorts, length, key, first, mesh, clients_per_step, members
) -> Executable:
    """The compiled round for cohorts of example length ``length``."""
    if isinstance(round_fn, Executable):
        if mesh is not None or clients_per_step is not None or members != "auto":
            raise PopulationError(
                "xla.simulate: round_fn is already compiled; pass mesh / clients_per_step "
                "/ members to xla.compile, not here"
            )
        return round_fn
    if isinstance(round_fn, Module):
        return _compile(round_fn, cohorts, mesh, clients_per_step, members)
    if not callable(round_fn):
        raise PopulationError(
            f"xla.simulate: round_fn must be an @fcir.program function, an fcir.Module or "
            f"an xla Executable, got {type(round_fn).__name__}"
        )
    args = _args(state, cohorts._specs(length), key, first)  # noqa: SLF001
    leaves, treedef = jax.tree.flatten(args)
    kind = (treedef, tuple(_type_of(x) for x in leaves), cohorts.size, mesh,
            clients_per_step, members)  # fmt: skip
    try:
        per_fn = _COMPILED.setdefault(round_fn, {})
    except TypeError:  # not weakly referable: compiled for this call only
        per_fn = {}
    if kind not in per_fn:
        module = capture(round_fn, *args)
        per_fn[kind] = _compile(module, cohorts, mesh, clients_per_step, members)
    return per_fn[kind]


def _type_of(x) -> tuple:
    return (tuple(np.shape(x)), str(x.dtype), bool(getattr(x, "weak_type", False)))


def _compile(module: Module, cohorts, mesh, clients_per_step, members) -> Executable:
    placed = [(p, n) for p, n in module.placements if p != "server"]
    if len(placed) != 1 or placed[0][1] != cohorts.size:
        raise PopulationError(
            f"xla.simulate: @{module.name} has placements {dict(placed)}, but a cohort is "
            f"one placement of {cohorts.size} members: declare "
            "@fcir.program(placements={'clients': cohorts.size})"
        )
    return xla_compile(module, mesh, clients_per_step, members=members)


def _traced(exe: Executable):
    """The executable as a function to call under a JAX trace (inside ``lax.scan``):
    its jitted program, results rebuilt into the program's pytree."""
    # The executable's own parts (same package), not the executable: the loops cached
    # per executable (weakly keyed) must not keep it alive.
    jitted, rebuild = exe._jitted, exe._rebuild  # noqa: SLF001

    def call(*args):
        out = jitted(*args)
        return out if rebuild is None else rebuild.unflatten(list(out))

    return call


def _has_metrics(exes: dict, state, cohorts, key, first) -> bool:
    """Whether the round returns ``(state, metrics)`` rather than the state alone (the
    same for every example length, metrics of the same shapes: they are stacked)."""
    want = jax.tree.structure(state)
    outs = []
    for length, exe in exes.items():
        specs = cohorts._specs(length)  # noqa: SLF001
        out = jax.eval_shape(_traced(exe), *_args(state, specs, key, first))
        if jax.tree.structure(out) == want:
            outs.append(None)
        elif isinstance(out, tuple) and len(out) == 2 and jax.tree.structure(out[0]) == want:
            outs.append(out[1])
        else:
            raise PopulationError(
                f"xla.simulate: the round must return the new state (structure {want}) or "
                f"(state, metrics); it returns {jax.tree.structure(out)}"
            )
    if any(m != outs[0] for m in outs):
        raise PopulationError(
            f"xla.simulate: the round's metrics differ between the cohorts' example lengths "
            f"{list(exes)} ({outs}); they are stacked round by round: return metrics whose "
            "shapes do not depend on the number of examples"
        )
    return bool(outs) and outs[0] is not None


def _split(out, has_metrics):
    return out if has_metrics else (out, None)


# -- the host loop ----------------------------------------------------------------------

# Cohorts that exist at once in the host loop: the one the running round reads, the next
# round's (dispatched behind it) and the one being gathered and put. Fewer leaves the
# device waiting for a transfer whenever gathering and putting a cohort takes about as
# long as a round (measured on a TPU v5e: 35 ms of gather and 22 ms of transfer for a
# 42 ms CIFAR round, 74.6 ms a round with one cohort ahead).
DEPTH = 3


def _depth(exes: dict, state, cohorts: Cohorts, key, first: int) -> int:
    """The cohorts that exist at once in the host loop: :data:`DEPTH`, or fewer where
    the device's memory does not hold them. XLA's memory analysis of a round (its peak)
    counts the running round's own cohort among its arguments; each cohort put ahead of
    it takes one cohort's bytes more. A round of ``clients_per_step="auto"`` is chosen
    to fill the memory: on a TPU, a cohort of 2,048 CIFAR clients streamed 385 at a time
    peaked at 15.8 of the chip's 16.9 GB, and the next cohort (1.3 GB) put beside it
    ran out of memory. 1: none ahead.

    A population the device loop keeps on the device (:func:`_on_device`) stays there
    where the rounds' peak fits beside it, its bytes taken from the room for cohorts
    ahead; else it is freed."""
    limit = _device_limit(exes)
    if limit is None:
        return DEPTH
    n = len(jax.tree.leaves(state))
    sizes = []  # (peak, cohort bytes) per example length
    for length, exe in exes.items():
        specs = cohorts._specs(length)  # noqa: SLF001
        sizes.append((_peak(exe, state, specs, key, first), _cohort_bytes(exe, specs, n)))
    kept = _resident_bytes()
    if kept and max(peak for peak, _ in sizes) + kept > limit:
        _release_population()
        kept = 0
    ahead = DEPTH - 1
    for peak, per in sizes:
        if per:
            ahead = min(ahead, max(0, (limit - kept - peak) // per))
    return 1 + int(ahead)


def _peak(exe: Executable, state, specs, key, first: int) -> int:
    """The round's peak bytes on one device, as XLA's memory analysis predicts it: the
    one ``clients_per_step="auto"`` chose by, else that of the compile its calls use
    (the same argument types)."""
    peak = (exe.streaming or {}).get("predicted_peak_bytes")
    if peak is None:
        peak = predicted_peak(exe.compiled(*_args(state, specs, key, first)))
    return int(peak)


def _device_limit(exes: dict) -> int | None:
    """Bytes one device of the rounds may hold (its allocator's ``bytes_limit``), or
    None where JAX does not say (CPU: the host's memory, which the cohorts share with
    everything else)."""
    exe = next(iter(exes.values()))
    device = next(iter(exe.mesh.devices.flat)) if exe.mesh is not None else jax.devices()[0]
    return allocator_limit(device)


def _cohort_bytes(exe: Executable, specs, state_leaves: int) -> int:
    """Bytes of one cohort on one device (on a mesh, its members split as the
    executable lays them out)."""
    leaves = jax.tree.leaves(specs)
    if exe.mesh is None:
        shapes = [x.shape for x in leaves]
    else:
        laid = exe.in_specs[state_leaves : state_leaves + len(leaves)]
        shapes = [s.sharding.shard_shape(x.shape) for x, s in zip(leaves, laid)]
    return sum(math.prod(sh) * np.dtype(x.dtype).itemsize for sh, x in zip(shapes, leaves))


def _put(exe: Executable, cohort, state_leaves: int):
    """The cohort on the executable's devices; on a mesh, laid out as the executable
    lays out its arguments (members along the placement's mesh axis)."""
    if exe.mesh is None:
        return jax.device_put(cohort)
    leaves, treedef = jax.tree.flatten(cohort)
    specs = exe.in_specs[state_leaves : state_leaves + len(leaves)]
    return treedef.unflatten([jax.device_put(x, s.sharding) for x, s in zip(leaves, specs)])


class _Feed:
    """Rounds' cohorts gathered on the host and put on the devices by a thread of its
    own, ahead of the rounds, so that neither the gather nor the transfer waits for a
    round or makes one wait. At most ``depth`` cohorts exist at once (:func:`_depth`:
    :data:`DEPTH`, or fewer where the device's memory is short): the thread takes room
    for one before gathering it, and the loop gives room back when a round has finished
    (:meth:`done`). The host arrays are ``depth`` sets (:class:`_HostArrays`), reused in
    turn: a set is written again only after the round that read its transfer has
    finished.

    ``plan``: the rounds' (indices, valid) sampled beforehand, or None to sample each
    round here. ``put(length, cohort)`` puts a cohort of that example length."""

    def __init__(self, cohorts: Cohorts, rounds: range, put: Callable, plan=None, depth=DEPTH):
        self._cohorts, self._rounds, self._put, self._plan = cohorts, rounds, put, plan
        self.depth = depth
        self._room = threading.Semaphore(depth)
        self._ready: queue.SimpleQueue = queue.SimpleQueue()
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="fcir-simulate-feed", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        host = [_HostArrays(self._cohorts) for _ in range(self.depth)]
        cohorts = self._cohorts
        try:
            for i, r in enumerate(self._rounds):
                self._room.acquire()
                if self._stop:
                    return
                if self._plan is None:
                    idx, valid = cohorts.indices(r)
                else:
                    idx, valid = self._plan[0][i], self._plan[1][i]
                length = cohorts._length(idx, valid)  # noqa: SLF001
                cohort = cohorts.take(idx, valid, out=host[i % self.depth].arrays(length))
                self._ready.put((r, length, self._put(length, cohort)))
        except BaseException as e:  # noqa: BLE001  raised in the loop's thread by get()
            self._ready.put((None, None, e))

    def get(self, r: int):
        """Round ``r``'s (example length, cohort on the devices); waits for the thread."""
        got, length, cohort = self._ready.get()
        if got is None:
            raise cohort
        assert got == r, (got, r)
        return length, cohort

    def done(self) -> None:
        """A round has finished: room for the next cohort."""
        self._room.release()

    def close(self) -> None:
        self._stop = True
        self._room.release()
        self._thread.join()


class _HostArrays:
    """One of the feed's sets of host arrays for a cohort: a flat buffer per leaf,
    viewed in the shape of the round's cohort and grown to the largest shape seen, so
    that rounds of several example lengths (bucketed cohorts) reuse the same memory,
    as much as the longest needs. The views of the last length are kept: rounds of one
    length write into the very same arrays."""

    def __init__(self, cohorts: Cohorts):
        self._cohorts = cohorts
        self._flat: list[np.ndarray] = []
        self._length: object = ()  # no length yet
        self._views = None

    def arrays(self, length):
        if length != self._length:
            specs, treedef = jax.tree.flatten(self._cohorts._specs(length))  # noqa: SLF001
            sizes = [math.prod(s.shape) for s in specs]
            if not self._flat:
                self._flat = [np.empty(0, s.dtype) for s in specs]
            self._flat = [
                f if f.size >= n else np.empty(n, s.dtype)
                for f, n, s in zip(self._flat, sizes, specs)
            ]
            views = [f[:n].reshape(s.shape) for f, n, s in zip(self._flat, sizes, specs)]
            self._views, self._length = treedef.unflatten(views), length
        return self._views


def _host_loop(exes, state, cohorts, rounds, key, first, has_metrics, callback, plan):
    metrics = []
    n = len(jax.tree.leaves(state))
    depth = _depth(exes, state, cohorts, key, first)
    feed = _Feed(cohorts, range(first, first + rounds),
                 lambda length, c: _put(exes[length], c, n), plan, depth)  # fmt: skip
    running = None  # the round dispatched before this one: (r, state, metrics)
    try:
        for r in range(first, first + rounds):
            if running is not None and depth == 1:  # no room for a cohort beside it
                _finish(running, feed, callback)
                running = None
            length, cohort = feed.get(r)
            out = exes[length](*_args(state, cohort, key, r))  # runs after `running`
            state, m = _split(out, has_metrics)
            if has_metrics:
                metrics.append(m)
            if running is not None:
                _finish(running, feed, callback)  # one round stays queued behind the device
            running = (r, state, m)
        if running is not None:
            _finish(running, feed, callback)
    finally:
        feed.close()
    stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *metrics) if has_metrics else None
    return state, stacked


def _finish(running, feed: _Feed, callback) -> None:
    """Waits for a dispatched round, frees its cohort's room, then calls ``callback``."""
    r, state, m = running
    jax.block_until_ready((state, m))
    feed.done()
    if callback is not None:
        callback(r, state, m)


# -- the device loop --------------------------------------------------------------------


def _slab(x: np.ndarray) -> np.ndarray:
    """A population leaf ``[N, ...]`` as the device loop keeps it: each client's values
    flat, in rows of 128 (``[N, ceil(D / 128), 128]``) where a client has at least 128
    (``D``), else ``[N, D]``. On a TPU an array's two minor dimensions are tiled by 128
    lanes, so a client's images ``[..., 32, 32, 3]`` would be padded 3 -> 128 and a
    gather of members copy tile fragments (42 ms a cohort on a v5e where the round takes
    42); as whole rows of 128 each member is whole tiles of its own."""
    d = math.prod(x.shape[1:])
    flat = x.reshape(x.shape[0], d)
    if d < LANES:
        return flat
    rows = -(-d // LANES)
    if rows * LANES != d:
        flat = np.pad(flat, ((0, 0), (0, rows * LANES - d)))
    return flat.reshape(x.shape[0], rows, LANES)


LANES = 128


def _unslab(members, shape) -> jax.Array:
    """Gathered members ``[k, ...]`` of :func:`_slab` back in the leaf's shape."""
    k, d = members.shape[0], math.prod(shape)
    return members.reshape(k, -1)[:, :d].reshape(k, *shape)


def _device_loop(exe, state, cohorts, rounds, key, first, has_metrics):
    arrays, gather, kind = _on_device(cohorts, exe.mesh)
    idx, _ = cohorts.plan(first, rounds)
    rs = np.arange(first, first + rounds, dtype=np.int32)
    run = _scan(exe, has_metrics, key is not None, kind, gather)
    explicit = exe._context  # noqa: SLF001  the mesh has Explicit axes
    # Outside the caller's jax.set_mesh, results come back relabelled as the
    # executable's own calls return them (Executable._outside_mesh).
    retype = explicit and exe._outside_mesh()  # noqa: SLF001
    with _mesh_context(exe.mesh if explicit else None):
        out = run(state, arrays, idx, rs, key)
    return jax.tree.map(exe._on_auto_axes, out) if retype else out  # noqa: SLF001


# The population the device loop ran on last, kept on the device for the next call of
# the device loop on it (rounds in chunks, an evaluation between them; a benchmark's
# repetitions): on a TPU v5e, putting bench/simulate.py's CIFAR population (614 MB)
# took about 61 ms a call, most of the device loop's cost over its compiled round at 20
# rounds a call. Safe because a population's arrays are read-only and no one writes to
# them (fcir.Population). One population at a time, so that device memory holds at
# most one: the device loop over another population, or on another device or mesh,
# frees it before putting its own; the host loop counts it beside its rounds, or frees
# it where they do not fit beside it (_depth); the population's garbage collection
# frees it too (weakly keyed).
_RESIDENT: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _on_device(cohorts: Cohorts, mesh):
    """The cohorts' population on the device as the device loop reads it, ``(arrays,
    gather, kind)`` (:func:`_dense_layout`, :func:`_ragged_layout`): kept from the last
    call where that was this population, layout and device, else put now."""
    pop = cohorts.population
    where = None if mesh is None else NamedSharding(mesh, PartitionSpec())
    length = None if pop.offsets is None else cohorts.lengths[0]
    on = where if mesh is not None else (jax.default_backend(), jax.config.jax_default_device)
    kept = _RESIDENT.get(pop)
    if kept is not None and kept[0] == (length, on):
        return kept[1]
    _release_population()  # one at a time: the memory holds it or ours
    arrays, gather, kind = _dense_layout(pop) if length is None else _ragged_layout(pop, length)
    laid = (jax.device_put(arrays, where), gather, kind)
    _RESIDENT[pop] = ((length, on), laid)
    return laid


def _resident_bytes() -> int:
    """Bytes of the population kept on the device (0: none)."""
    return sum(x.nbytes for _, (arrays, _, _) in _RESIDENT.values()
               for x in jax.tree.leaves(arrays))  # fmt: skip


def _release_population() -> None:
    """Frees the population the device loop keeps on the device between calls."""
    _RESIDENT.clear()


def _dense_layout(pop):
    """A dense population on the device, ``(arrays, gather, kind)``: each leaf as
    :func:`_slab`s, ``gather(arrays, idx)`` a cohort's (data, counts) from them, and
    ``kind`` what the compiled loop depends on."""
    leaves = jax.tree.leaves(pop.data)
    shapes = tuple(x.shape[1:] for x in leaves)
    treedef = jax.tree.structure(pop.data)

    def gather(arrays, i):
        slabs, counts = arrays

        # Padding members' index N is past the end: their rows are filled with zeros.
        def take(x):
            return jnp.take(x, i, 0, mode="fill", fill_value=0)

        data = treedef.unflatten([_unslab(take(x), sh) for x, sh in zip(slabs, shapes)])
        return data, take(counts)

    arrays = ([_slab(np.asarray(x)) for x in leaves], pop.counts)
    return arrays, gather, ("dense", treedef, shapes)


def _ragged_layout(pop, length: int):
    """A ragged population on the device, as :func:`_dense_layout`: each leaf's examples
    concatenated as they are on the host, followed by ``length`` zero examples (a
    member's window of ``length`` examples never runs off the end, and padding members,
    index ``N``, start there), each example's values as whole rows of 128 where it has
    at least 128 (:func:`_slab`), else all the values in one flat array (on a TPU a
    minor dimension under 128 is padded to 128 lanes). ``gather`` slices each member's
    window and zeroes its examples past its count."""
    leaves = jax.tree.leaves(pop.data)
    shapes = tuple(x.shape[1:] for x in leaves)
    treedef = jax.tree.structure(pop.data)
    slabs, flat = [], []
    for x in leaves:
        slab = _slab(np.concatenate([x, np.zeros((length, *x.shape[1:]), x.dtype)]))
        one = slab.ndim == 2 and slab.size < 2**31  # int32 offsets into the values
        slabs.append(slab.reshape(-1) if one else slab)
        flat.append(math.prod(x.shape[1:]) if one else None)
    starts = pop.offsets.astype(np.int32)  # [N + 1]: index N starts at the zeros
    rows = np.append(pop._rows, 0).astype(np.int32)  # noqa: SLF001
    counts = np.append(pop.counts, np.float32(0))

    def gather(arrays, i):
        slabs, starts, rows, counts = arrays
        keep = jnp.arange(length) < rows[i][:, None]  # [k, length]: the member's own
        data = [_window(x, starts[i], length, per, sh, keep)
                for x, per, sh in zip(slabs, flat, shapes)]  # fmt: skip
        return treedef.unflatten(data), counts[i]

    arrays = (slabs, starts, rows, counts)
    return arrays, gather, ("ragged", treedef, shapes, length, tuple(flat))


def _window(x, start, length: int, per: int | None, shape, keep) -> jax.Array:
    """Members ``[k, length, *shape]``: the ``length`` examples from each of ``start``
    of the leaf ``x`` (a slab, or flat with ``per`` values an example), zero where not
    ``keep``."""
    k = start.shape[0]
    if length == 0:
        return jnp.zeros((k, 0, *shape), x.dtype)
    if per is None:
        w = jax.vmap(lambda s: jax.lax.dynamic_slice_in_dim(x, s, length, 0))(start)
    else:
        w = jax.vmap(lambda s: jax.lax.dynamic_slice_in_dim(x, s * per, length * per, 0))(start)
    examples = _unslab(w.reshape(k * length, -1), shape).reshape(k, length, *shape)
    keep = keep.reshape(k, length, *(1,) * len(shape))
    return jnp.where(keep, examples, jnp.zeros((), x.dtype))


_SCANS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _scan(exe, has_metrics: bool, keyed: bool, kind, gather):
    """One jitted scan over the rounds per (executable, kind of round, population
    layout): a second simulate of the same executable reuses the compiled loop."""
    per_exe = _SCANS.setdefault(exe, {})
    which = (has_metrics, keyed, kind)
    if which not in per_exe:
        per_exe[which] = _make_scan(_traced(exe), has_metrics, keyed, gather)
    return per_exe[which]


def _make_scan(call, has_metrics: bool, keyed: bool, gather):

    def run(state, arrays, idx, rs, key):
        def step(s, xs):
            i, r = xs
            out = call(*_args(s, gather(arrays, i), key if keyed else None, r))
            return _split(out, has_metrics)

        state, ms = jax.lax.scan(step, state, (idx, rs))
        return state, (ms if has_metrics else None)

    return jax.jit(run)
