"""What the ServerApp and the ClientApp share: the plan, the parts' jax.export artifacts,
arrays on the wire, and the aggregations.

This package is copied verbatim into every exported app, so it imports only jax, numpy
and flwr (a device installs those, never fcir nor the program's source), and the
files the export copies beside it (production's ``intrinsics.py``).

The artifacts ride inside the app bundle itself, base64 in ``artifacts.json``: Flower's
app bundle (FAB) takes only text files, and a JSON file is text. The FAB is hashed,
shipped once per run to the SuperLink and every SuperNode, and installed by Flower, so
the code needs no per-round bytes (messages) and no out-of-band copy onto each device
(staging). Each artifact's sha256 is checked before it is loaded.
"""

from __future__ import annotations

import base64
import functools
import hashlib
import json
import pathlib
import threading

import numpy as np

try:  # in an exported app: production's table of intrinsics, copied beside this file
    from . import intrinsics
except ImportError:  # in fcir itself
    from fcir.interpreters.production import intrinsics

# jax is imported where it is used, not here: a ClientApp process starts for every
# message, and the messages of SecAgg+'s key stages never reach fcir's code (the mod
# answers them), so they need not pay for importing jax.

HERE = pathlib.Path(__file__).resolve().parent
PLAN_FILE = "plan.json"
ARTIFACTS_FILE = "artifacts.json"
INPUTS_FILE = "inputs.json"
RAW = "fcir.raw"  # Array.stype of our arrays: C-order bytes, little endian, dtype by name


class AppError(RuntimeError):
    """The app, its data or its configuration is wrong; the message says what to fix."""


# fcir's earlier run config names -> Flower's (its FedAvg's), which the app now takes.
RENAMED_RUN_CONFIG = {
    "rounds": "num-server-rounds",
    "fraction": "fraction-train",
    "min-clients": "min-train-nodes",
}


def renamed(keys) -> list[str]:
    """One sentence per old run config name among ``keys``, naming Flower's."""
    return [
        f"run config {k} is now {RENAMED_RUN_CONFIG[k]} (Flower's name)"
        for k in keys
        if k in RENAMED_RUN_CONFIG
    ]


def refuse_renamed(run_config) -> None:
    """Refuses a run config that uses an old name (``flwr run`` refuses keys that
    pyproject.toml does not declare; an in-process run gets this message)."""
    old = renamed(run_config)
    if old:
        raise AppError("; ".join(old) + ": rename it in --run-config")


@functools.cache
def plan() -> dict:
    return json.loads((HERE / PLAN_FILE).read_text())


@functools.cache
def app_digest() -> str:
    """sha256 over the app's plan, artifacts and embedded inputs: what a checkpoint of
    this app must have been written by."""
    h = hashlib.sha256()
    for name in (PLAN_FILE, ARTIFACTS_FILE, INPUTS_FILE):
        p = HERE / name
        h.update(p.read_bytes() if p.is_file() else b"-")
    return h.hexdigest()


@functools.cache
def _artifacts() -> dict:
    return json.loads((HERE / ARTIFACTS_FILE).read_text())


def artifact_bytes(key: str) -> bytes:
    """The artifact stored under ``key``, its sha256 checked."""
    entry = _artifacts()[key]
    data = base64.b64decode(entry["base64"])
    if hashlib.sha256(data).hexdigest() != entry["sha256"]:
        raise AppError(f"artifact {key}: sha256 mismatch (corrupt or modified app)")
    return data


@functools.cache
def exported(key: str):
    """The ``jax.export.Exported`` stored under ``key``, its sha256 checked."""
    import jax

    return jax.export.deserialize(bytearray(artifact_bytes(key)))


_COMPILED: dict = {}
_LOCKS: dict = {}
_LOCKS_LOCK = threading.Lock()


def compiled(key: str):
    """The artifact under ``key`` compiled for its own argument shapes, once: a caller
    that finds a background thread compiling it waits for that compile."""
    with _LOCKS_LOCK:
        lock = _LOCKS.setdefault(key, threading.Lock())
    with lock:
        if key not in _COMPILED:
            import jax

            exp = exported(key)
            specs = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in exp.in_avals]
            _COMPILED[key] = jax.jit(exp.call).lower(*specs).compile()
        return _COMPILED[key]


def precompile(keys) -> None:
    """Compiles ``keys`` in a background thread: the server compiles the parts it runs
    after an exchange while it waits for the clients (polling leaves the CPU idle)."""
    def work():
        for key in keys:
            try:
                compiled(key)
            except Exception:  # noqa: BLE001  (the foreground call reports it)
                return

    threading.Thread(target=work, daemon=True).start()


def call(part: dict, env: dict) -> None:
    """Runs ``part`` (a plan entry: artifact, params, results) on ``env``'s values."""
    args = [env[tuple(p)] for p in part["params"]]
    if not part["results"]:
        return
    outs = compiled(part["artifact"])(*args)
    env.update(zip((tuple(r) for r in part["results"]), outs))


def np_dtype(name: str) -> np.dtype:
    try:
        return np.dtype(name)
    except TypeError:  # bfloat16, float8_*: ml_dtypes (a jax dependency) defines them
        import ml_dtypes

        return np.dtype(getattr(ml_dtypes, name))


def describe(dtype, shape) -> str:
    return f"{np.dtype(dtype).name}[{','.join(str(d) for d in shape)}]"


def check_leaf(x, spec: dict, what: str) -> np.ndarray:
    """``x`` as an array of ``spec``'s dtype and shape; AppError naming ``what`` if not."""
    x = np.asarray(x)
    want = describe(np_dtype(spec["dtype"]), spec["shape"])
    got = describe(x.dtype, x.shape)
    if got != want:
        raise AppError(f"{what}: needs an array of {want}, got {got}")
    return x


# --- arrays on the wire -------------------------------------------------------------------


def to_array(x):
    from flwr.app import Array

    x = np.asarray(x, order="C")  # (np.ascontiguousarray would make 0-d arrays 1-d)
    dt = x.dtype.newbyteorder("<") if x.dtype.byteorder == ">" else x.dtype
    return Array(dtype=dt.name, shape=tuple(x.shape), stype=RAW, data=x.astype(dt).tobytes())


def from_array(a) -> np.ndarray:
    if a.stype != RAW:
        return a.numpy()
    return np.frombuffer(a.data, dtype=np_dtype(a.dtype)).reshape(a.shape)


def to_record(values: dict):
    from flwr.app import ArrayRecord

    return ArrayRecord({k: to_array(v) for k, v in values.items()})


def from_record(record) -> dict:
    return {k: from_array(v) for k, v in record.items()}


def record_bytes(record) -> int:
    return sum(len(a.data) for a in record.values())


# --- npz files (the layout of ``fcir run-plan``: arr_0, arr_1, ...) -----------------------


def read_leaves(path: str, what: str) -> list[np.ndarray]:
    p = pathlib.Path(path)
    if not p.is_file():
        raise AppError(f"{what}: no such file {path}")
    try:
        with np.load(p, allow_pickle=False) as data:
            keys = sorted(data.files, key=lambda k: (len(k), k))
            if keys != [f"arr_{i}" for i in range(len(keys))]:
                raise AppError(
                    f"{what}: {path} must hold arr_0, arr_1, ... as np.savez(*leaves) writes "
                    f"them, found {sorted(data.files)}"
                )
            return [data[k] for k in keys]
    except AppError:
        raise
    except Exception as e:  # noqa: BLE001  (np.load raises assorted errors on bad files)
        raise AppError(f"{what}: cannot read {path}: {type(e).__name__}: {e}") from None


def load_leaves(path: str, specs: list[dict], what: str) -> list[np.ndarray]:
    leaves = read_leaves(path, what)
    if len(leaves) != len(specs):
        raise AppError(
            f"{what}: {path} holds {len(leaves)} array(s); the round takes {len(specs)} "
            f"({', '.join(describe(np_dtype(s['dtype']), s['shape']) for s in specs)})"
        )
    return [check_leaf(x, s, f"{what}: {path} arr_{i}") for i, (x, s) in enumerate(zip(leaves, specs))]


def embedded_inputs() -> list[np.ndarray] | None:
    p = HERE / INPUTS_FILE
    if not p.is_file():
        return None
    entries = json.loads(p.read_text())
    return [
        np.frombuffer(base64.b64decode(e["base64"]), np_dtype(e["dtype"])).reshape(tuple(e["shape"]))
        for e in entries
    ]


# --- aggregation over the clients that replied --------------------------------------------
#
# The same jnp calls as fcir's primitives (fcir/opkit/primitives.py), over a leading axis of
# the k replies instead of the round's static client count: with every client replying,
# the result is bit for bit the bundle's aggregation part.


@functools.cache
def _server_aggregate(source: str):
    """The function a plan's aggregation carries for an op with no intrinsic (the
    source of its fed op's ``server_aggregate``, written by the export): jnp and numpy
    only, over the replies stacked on axis 0."""
    namespace = {"np": np}
    exec(compile(source, "<plan.json server_aggregate>", "exec"), namespace)
    return namespace["server_aggregate"]


# The server's side of each aggregation intrinsic the production split uses, by the
# intrinsic's name (a plan aggregation's "aggregate"): production's table of intrinsics,
# which the app carries beside this file. An op with no intrinsic travels as its own
# server_aggregate source instead.
AGGREGATES = intrinsics.aggregates()
# Summed by SecAgg+ (secagg.py) when the run config turns it on.
SECURE_SUM = intrinsics.SECURE_SUM


def is_secure_sum(agg: dict) -> bool:
    return agg.get("aggregate") == SECURE_SUM


def _reduce(x, w, *, aggregate: str | None, bitwidth: int | None, attrs: tuple = (),
            source: str | None = None):
    if source is not None:
        # An op with no intrinsic (an order statistic): the server sees every value.
        return _server_aggregate(source)(x, **dict(attrs))
    if aggregate not in AGGREGATES:
        raise AppError(f"no aggregation {aggregate}")
    return AGGREGATES[aggregate](x, w, bitwidth=bitwidth, attrs=attrs)


@functools.cache
def _reduce_all():
    import jax

    def reduce_all(stacked, *, ops):
        return [
            _reduce(x, w, aggregate=aggregate, bitwidth=bw, attrs=attrs, source=source)
            for (x, w), (aggregate, bw, attrs, source) in zip(stacked, ops)
        ]

    return jax.jit(reduce_all, static_argnames=("ops",))


def aggregate(aggregations: list[dict], replies: list[dict]) -> dict:
    """The plan's aggregations over the replies' client outputs, compiled as one
    function (one compile per exchange, not one per aggregation): output name -> value."""
    stacked, ops = [], []
    for agg in aggregations:
        names = agg["inputs"]
        x = np.stack([r[names[0]] for r in replies])
        w = np.stack([r[names[1]] for r in replies]) if len(names) > 1 else None
        stacked.append((x, w))
        attrs = tuple(sorted(agg.get("attrs", {}).items()))
        ops.append((agg.get("aggregate"), agg["bitwidth"], attrs, agg.get("server_aggregate")))
    outs = _reduce_all()(stacked, ops=tuple(ops))
    return {agg["output"]: y for agg, y in zip(aggregations, outs)}


# --- secure sums as 16-bit chunks (SecAgg+) -----------------------------------------------
#
# Flower's SecAgg+ sums float vectors by quantizing them. With clipping range 2**15,
# quantization range 2**16 and weight 1, a float v in [-2**15, 2**15) quantizes to the
# integer v + 2**15 exactly (the "stochastic" rounding has nothing to round), and the
# masked sum of k clients' chunks is taken modulo 2**32: exact while k * 2**16 < 2**32.
# So each client sends its value's low ``bitwidth`` bits as 16-bit chunks minus 2**15,
# and the server rebuilds the sum modulo 2**bitwidth from the per-chunk sums.

CHUNK_BITS = 16
SECAGG_CLIPPING = float(2**15)
SECAGG_QUANTIZATION = 2**16
SECAGG_MODULUS = 2**32


def n_chunks(bitwidth: int) -> int:
    return -(-bitwidth // CHUNK_BITS)


def to_chunks(x, bitwidth: int) -> np.ndarray:
    """``x`` (an integer array) as float64 chunks of shape ``(n_chunks, *x.shape)``: chunk
    j holds bits 16j..16j+15 of x's two's-complement bits, minus 2**15."""
    x = np.asarray(x)
    bits = x.astype(np.uint64) if x.dtype.kind == "u" else x.view(f"u{x.dtype.itemsize}").astype(np.uint64)
    out = np.empty((n_chunks(bitwidth),) + x.shape, np.float64)
    for j in range(out.shape[0]):
        out[j] = ((bits >> np.uint64(CHUNK_BITS * j)) & np.uint64(0xFFFF)).astype(np.float64) - 2.0**15
    return out


def chunk_sums(means: np.ndarray, k: int) -> np.ndarray:
    """The per-chunk sums of ``k`` clients from what SecAgg+ returns: their mean of
    ``chunk - 2**15`` (it divides by the total weight k). The sums are integers below
    2**32, so rounding undoes the float division exactly."""
    return np.rint(np.asarray(means, np.float64) * k + k * 2.0**15).astype(np.uint64)


def from_chunk_sums(sums: np.ndarray, bitwidth: int, dtype) -> np.ndarray:
    """The sum modulo 2**bitwidth from the per-chunk sums, as ``dtype`` (the low
    ``bitwidth`` bits; a full-width signed sum is its bits read as signed, as the
    reference's wrapping sum gives it)."""
    dtype = np.dtype(dtype)
    total = np.zeros(sums.shape[1:], np.uint64)
    for j in range(sums.shape[0]):
        total += sums[j] << np.uint64(CHUNK_BITS * j)  # wraps modulo 2**64: fine, b <= 64
    if bitwidth < 64:
        total &= np.uint64((1 << bitwidth) - 1)
    unsigned = total.astype(f"u{dtype.itemsize}")
    return unsigned.view(dtype) if dtype.kind == "i" else unsigned.astype(dtype)


def secure_inputs(step: dict) -> list[tuple[str, int]]:
    """The exchange's secure sums: (client output name, bitwidth), in plan order."""
    return [(a["inputs"][0], a["bitwidth"]) for a in step["aggregations"] if is_secure_sum(a)]


def plain_inputs(step: dict) -> list[str]:
    """The client outputs the exchange's other aggregations read (sent in the clear)."""
    names: list[str] = []
    for a in step["aggregations"]:
        if not is_secure_sum(a):
            names += [n for n in a["inputs"] if n not in names]
    return names


def pack(values: dict, prefix: str) -> dict:
    """Arrays as ConfigRecord entries (the legacy FitIns/FitRes that SecAgg+ carries
    have no named arrays): ``prefix+key`` -> raw bytes, ``prefix+key+"#"`` -> dtype and
    shape."""
    out: dict = {}
    for k, v in values.items():
        a = to_array(v)
        out[prefix + k] = a.data
        out[prefix + k + "#"] = f"{a.dtype}:{','.join(str(d) for d in a.shape)}"
    return out


def unpack(record, prefix: str) -> dict:
    out = {}
    for k, v in record.items():
        if k.startswith(prefix) and not k.endswith("#"):
            dtype, _, shape = str(record[k + "#"]).partition(":")
            dims = tuple(int(d) for d in shape.split(",") if d)
            out[k[len(prefix):]] = np.frombuffer(v, dtype=np_dtype(dtype)).reshape(dims)
    return out
