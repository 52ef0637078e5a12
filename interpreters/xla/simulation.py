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
mesh, clients_per_step, members=members)``), or an ``fcir.Module`` of that signature, or
an ``xla.compile``'d Executable. ``members="auto"`` (the default here; ``xla.compile``'s
is ``"vmap"``) runs the members one after another on CPU when a convolution is inside
their ``fed.map`` (``fcir.interpreters.xla.members``: XLA:CPU runs convolutions inside
loops and vmapped ones slowly), else all at once.

Two loops, one result (the same cohorts and keys; ``loop=`` picks, ``"auto"`` by size):

- ``"device"``: the population is put on the device once (on a mesh, replicated on
  each of its devices) and all the rounds run in one compiled ``lax.scan``; each step
  gathers its cohort on the device from the cohorts' indices, sampled beforehand on the
  host. One dispatch for the whole run. ``"auto"`` picks it when the population takes at
  most a quarter of the device's memory (1 GiB where JAX does not say, as on CPU), there
  is no mesh and no callback.
- ``"host"``: the population stays in host memory. A thread gathers each round's cohort
  on the host and puts it on the devices ahead of the rounds, and each round is
  dispatched before the one ahead of it has finished, then that one is waited for:
  neither the gather, the transfer nor a wait leaves the device idle, and at most three
  cohorts exist at once (the running round's, the queued round's, the one being put).
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
from .executable import Executable, _mesh_context

__all__ = ["device_budget", "simulate"]

LOOPS = ("auto", "device", "host")


def device_budget(device=None) -> int:
    """Bytes of population that ``loop="auto"`` puts on ``device``: a quarter of its
    memory, or 1 GiB where JAX reports none (CPU)."""
    device = device or jax.devices()[0]
    try:
        stats = device.memory_stats() or {}
    except Exception:  # noqa: BLE001  some backends raise instead of returning None
        stats = {}
    limit = stats.get("bytes_limit")
    return int(limit) // 4 if limit else 2**30


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
    if not isinstance(cohorts, Cohorts):
        raise PopulationError(
            f"xla.simulate: cohorts must be fcir.Cohorts (Population.uniform / .poisson), "
            f"got {type(cohorts).__name__}"
        )
    if isinstance(rounds, bool) or not isinstance(rounds, (int, np.integer)) or rounds < 0:
        raise PopulationError(f"xla.simulate: rounds must be an int >= 0, got {rounds!r}")
    if isinstance(first_round, bool) or not isinstance(first_round, (int, np.integer)) or (
        first_round < 0
    ):
        raise PopulationError(
            f"xla.simulate: first_round must be an int >= 0, got {first_round!r}"
        )
    if loop not in LOOPS:
        raise PopulationError(f"xla.simulate: loop must be one of {LOOPS}, got {loop!r}")
    if callback is not None and loop == "device":
        raise PopulationError(
            "xla.simulate: callback runs after each round of the host loop; the device "
            "loop runs all rounds in one program: pass loop='host' (or no callback)"
        )
    rounds, first_round = int(rounds), int(first_round)
    exe = _executable(
        round_fn, state, cohorts, key, first_round, mesh, clients_per_step, members
    )
    call = _traced(exe)
    has_metrics = _has_metrics(call, state, cohorts, key, first_round)
    if rounds == 0:
        return state, None
    if loop == "auto":
        fits = cohorts.population.nbytes <= device_budget()
        loop = "device" if fits and callback is None and mesh is None else "host"
    if loop == "device":
        return _device_loop(exe, call, state, cohorts, rounds, key, first_round, has_metrics)
    return _host_loop(exe, state, cohorts, rounds, key, first_round, has_metrics, callback)


# -- the round --------------------------------------------------------------------------


def _round_key(key, r):
    return jax.random.fold_in(key, r)


def _args(state, cohort, key, r):
    data, counts = cohort
    return (state, data, counts) if key is None else (state, data, counts, _round_key(key, r))


def _executable(
    round_fn, state, cohorts, key, first, mesh, clients_per_step, members
) -> Executable:
    if isinstance(round_fn, Executable):
        if mesh is not None or clients_per_step is not None or members != "auto":
            raise PopulationError(
                "xla.simulate: round_fn is already compiled; pass mesh / clients_per_step "
                "/ members to xla.compile, not here"
            )
        return round_fn
    if isinstance(round_fn, Module):
        module = round_fn
    elif callable(round_fn):
        module = capture(round_fn, *_args(state, cohorts.specs(), key, first))
    else:
        raise PopulationError(
            f"xla.simulate: round_fn must be an @fcir.program function, an fcir.Module or "
            f"an xla Executable, got {type(round_fn).__name__}"
        )
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


def _has_metrics(call, state, cohorts, key, first) -> bool:
    """Whether the round returns ``(state, metrics)`` rather than the state alone."""
    out = jax.eval_shape(call, *_args(state, cohorts.specs(), key, first))
    want = jax.tree.structure(state)
    if jax.tree.structure(out) == want:
        return False
    if isinstance(out, tuple) and len(out) == 2 and jax.tree.structure(out[0]) == want:
        return True
    raise PopulationError(
        f"xla.simulate: the round must return the new state (structure {want}) or "
        f"(state, metrics); it returns {jax.tree.structure(out)}"
    )


def _split(out, has_metrics):
    return out if has_metrics else (out, None)


# -- the host loop ----------------------------------------------------------------------

# Cohorts that exist at once in the host loop: the one the running round reads, the next
# round's (dispatched behind it) and the one being gathered and put. Fewer leaves the
# device waiting for a transfer whenever gathering and putting a cohort takes about as
# long as a round (measured on a TPU v5e: 35 ms of gather and 22 ms of transfer for a
# 42 ms CIFAR round, 74.6 ms a round with one cohort ahead).
DEPTH = 3


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
    round or makes one wait. At most :data:`DEPTH` cohorts exist at once: the thread
    takes room for one before gathering it, and the loop gives room back when a round
    has finished (:meth:`done`). The host arrays are :data:`DEPTH` sets, reused in turn:
    a set is written again only after the round that read its transfer has finished."""

    def __init__(self, cohorts: Cohorts, rounds: range, put: Callable):
        self._cohorts, self._rounds, self._put = cohorts, rounds, put
        self._room = threading.Semaphore(DEPTH)
        self._ready: queue.SimpleQueue = queue.SimpleQueue()
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="fcir-simulate-feed", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        host = [None] * DEPTH
        try:
            for i, r in enumerate(self._rounds):
                self._room.acquire()
                if self._stop:
                    return
                if host[i % DEPTH] is None:
                    host[i % DEPTH] = self._cohorts.empty()
                cohort = self._cohorts.take(*self._cohorts.indices(r), out=host[i % DEPTH])
                self._ready.put((r, self._put(cohort)))
        except BaseException as e:  # noqa: BLE001  raised in the loop's thread by get()
            self._ready.put((None, e))

    def get(self, r: int):
        """Round ``r``'s cohort on the devices (waits for the thread)."""
        got, cohort = self._ready.get()
        if got is None:
            raise cohort
        assert got == r, (got, r)
        return cohort

    def done(self) -> None:
        """A round has finished: room for the next cohort."""
        self._room.release()

    def close(self) -> None:
        self._stop = True
        self._room.release()
        self._thread.join()


def _host_loop(exe, state, cohorts, rounds, key, first, has_metrics, callback):
    metrics = []
    n = len(jax.tree.leaves(state))
    feed = _Feed(cohorts, range(first, first + rounds), lambda c: _put(exe, c, n))
    running = None  # the round dispatched before this one: (r, state, metrics)
    try:
        for r in range(first, first + rounds):
            out = exe(*_args(state, feed.get(r), key, r))  # dispatched: runs after `running`
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


def _device_loop(exe, call, state, cohorts, rounds, key, first, has_metrics):
    pop = cohorts.population
    shapes = [x.shape[1:] for x in jax.tree.leaves(pop.data)]
    slabs = [_slab(np.asarray(x)) for x in jax.tree.leaves(pop.data)]
    where = None if exe.mesh is None else NamedSharding(exe.mesh, PartitionSpec())
    slabs, counts = jax.device_put((slabs, pop.counts), where)
    idx, _ = cohorts.plan(first, rounds)
    rs = np.arange(first, first + rounds, dtype=np.int32)
    treedef = jax.tree.structure(pop.data)
    run = _scan(exe, call, has_metrics, key is not None, treedef, tuple(shapes))
    explicit = exe._context  # noqa: SLF001  the mesh has Explicit axes
    # Outside the caller's jax.set_mesh, results come back relabelled as the
    # executable's own calls return them (Executable._outside_mesh).
    retype = explicit and exe._outside_mesh()  # noqa: SLF001
    with _mesh_context(exe.mesh if explicit else None):
        out = run(state, slabs, counts, idx, rs, key)
    return jax.tree.map(exe._on_auto_axes, out) if retype else out  # noqa: SLF001


_SCANS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _scan(exe, call, has_metrics: bool, keyed: bool, treedef, shapes):
    """One jitted scan over the rounds per (executable, kind of round, population
    layout): a second simulate of the same executable reuses the compiled loop."""
    per_exe = _SCANS.setdefault(exe, {})
    kind = (has_metrics, keyed, treedef, shapes)
    if kind not in per_exe:
        per_exe[kind] = _make_scan(call, has_metrics, keyed, treedef, shapes)
    return per_exe[kind]


def _make_scan(call, has_metrics: bool, keyed: bool, treedef, shapes):

    def run(state, slabs, counts, idx, rs, key):
        def step(s, xs):
            i, r = xs
            # Padding members' index N is past the end: their rows are filled with zeros.
            def take(x):
                return jnp.take(x, i, 0, mode="fill", fill_value=0)

            data = treedef.unflatten([_unslab(take(x), sh) for x, sh in zip(slabs, shapes)])
            out = call(*_args(s, (data, take(counts)), key if keyed else None, r))
            s, m = _split(out, has_metrics)
            return s, m

        state, ms = jax.lax.scan(step, state, (idx, rs))
        return state, (ms if has_metrics else None)

    return jax.jit(run)
