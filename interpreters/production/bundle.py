"""The production bundle on disk, and running one with nothing but the bundle.

Layout (``manifest.json`` lists every other file with its sha256)::

    manifest.json                versions, parts, how values flow between them
    round.computation.pb         the round as a federated_language Computation
    round.fcir, round.pb         the round's fcir IR (text with full constants; protobuf)
    parts/<part>.fcir, .pb       each part's fcir IR
    parts/<part>.stablehlo       each part's code, a serialized jax.export artifact
    parts/<part>.hlo.pb          each part's code, a serialized xla.HloModuleProto

``client_work``'s code is member-level: it takes and returns one client's values. The
other parts' code takes their parameters as the IR types them (client-placed values
with a leading axis of one row per client).

Values flow between parts by name: a part's parameters and results are ``(group,
name)`` pairs, groups being ``arg`` (round argument leaf), ``broadcast_input``,
``temporary``, ``broadcast_output``, ``client_output``, ``aggregated`` and ``output``
(round result leaf). ``run_bundle`` plays the DistributeAggregateForm with them:
server_prepare, the broadcast, client_work once per client, the aggregation, then
server_result.
"""

from __future__ import annotations

import hashlib
import json
import pathlib
import platform

import jax
import numpy as np

import fcir
from fcir.base_interpreter import as_input
from fcir.errors import FcirError
from fcir.frontend import pytrees
from fcir.ir import Module
from fcir.ir.types import dtype_name, runtime_type

from . import iree, iree_runtime, lowering
from .rewrite import member_type
from .splitting import PARTS, RUNS_ON, part_interface

FORMAT = "fcir.production.bundle"
FORMAT_VERSION = 1
COMPUTATION_SCHEMA = "federated_language.Computation (federated_language 0.5, TFF 0.87)"


class BundleError(FcirError):
    """A bundle is missing, corrupt, or does not match the arguments it is run with."""


# --- writing ------------------------------------------------------------------------------


def _entries(pairs, values, module: Module, member: bool) -> list[dict]:
    out = []
    for (g, n), v in zip(pairs, values):
        t = member_type(v.type) if member else runtime_type(v.type, module.cardinality)
        out.append({"group": g, "name": n, "type": str(v.type), "runtime": str(t)})
    return out


def _versions() -> dict:
    import google.protobuf
    import jaxlib

    return {
        "fcir": fcir.__version__,
        "fcir_ir_version": fcir.IR_VERSION,
        "jax": jax.__version__,
        "jaxlib": jaxlib.__version__,
        "protobuf": google.protobuf.__version__,
        "python": platform.python_version(),
        "computation_schema": COMPUTATION_SCHEMA,
    }


def write(plan, directory, *, device_runtime="jax", device_targets=(), inputs=None) -> pathlib.Path:
    out = pathlib.Path(directory)
    if out.exists() and not out.is_dir():  # e.g. -o round.fcir, the input itself
        raise BundleError(
            f"{out} is a file, not a directory: a production bundle is a directory; "
            "give -o a new directory"
        )
    device = None
    has_client_work = bool(part_interface(plan)["client_work"][1])
    if device_runtime == "iree" and has_client_work:  # first: if IREE is wrong, write nothing
        extra = iree.round_client_inputs(plan, inputs) if inputs is not None else ()
        fn, specs = lowering.flat_function(plan.code("client_work"))
        device = iree.compile_verified("client_work", fn, specs, device_targets, extra)
    elif device_runtime not in ("jax", "iree"):
        raise BundleError(f"device runtime {device_runtime!r}: choose jax or iree")
    (out / "parts").mkdir(parents=True, exist_ok=True)
    files: dict[str, bytes] = {
        "round.computation.pb": plan.to_computation_bytes(),
        "round.fcir": plan.round.to_text(full_constants=True).encode(),
        "round.pb": plan.round.serialize(),
    }
    hlo = plan.hlo_modules()
    stablehlo = plan.stablehlo_artifacts()
    interface = part_interface(plan)
    parts = {}
    platforms: set[str] = set()
    for name in PARTS:
        module = plan.split.parts[name]
        code = plan.code(name)
        member = name == "client_work"
        base = f"parts/{name}"
        files[f"{base}.fcir"] = module.to_text(full_constants=True).encode()
        files[f"{base}.pb"] = module.serialize()
        files[f"{base}.stablehlo"], plats = stablehlo[name]
        files[f"{base}.hlo.pb"] = hlo[name]
        platforms.update(plats)
        params, results = interface[name]
        parts[name] = {
            "runs_on": RUNS_ON[name],
            "code": "one client's values" if member else "the part's IR types",
            "signature": plan.signature(name),
            "params": _entries(params, code.main.body.params, code, member),
            "results": _entries(results, code.main.body.results, code, member),
            "platforms": list(plats),
            "files": {
                "fcir": f"{base}.fcir",
                "pb": f"{base}.pb",
                "stablehlo": f"{base}.stablehlo",
                "hlo": f"{base}.hlo.pb",
            },
        }
    if device is not None:
        rels = {t: f"parts/client_work.{t}.vmfb" for t in device.modules}
        for t, data in device.modules.items():
            files[rels[t]] = data
        parts["client_work"]["iree"] = device.manifest(rels)
    main = plan.round.main
    manifest = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "round": plan.round.name,
        "placements": [[p, n] for p, n in plan.round.placements],
        "aggregate_with": plan.aggregate_with,
        "signature": plan.round_signature(),
        "versions": _versions(),
        "inputs": [
            {
                "leaf": i,
                "type": str(v.type),
                "runtime": str(runtime_type(v.type, plan.round.cardinality)),
            }
            for i, v in enumerate(main.body.params)
        ],
        "outputs": [{"leaf": i, "type": str(v.type)} for i, v in enumerate(main.body.results)],
        "aggregations": [
            {
                "intrinsic": a.intrinsic,
                "fed_op": a.fed_op,
                "inputs": list(a.inputs),
                "output": a.output,
                "bitwidth": a.bitwidth,
                "source": a.source,
                **({"attrs": dict(a.attrs)} if a.attrs else {}),
            }
            for a in plan.split.aggregations
        ],
        "parts": parts,
        "files": {},
    }
    if device_runtime != "jax":
        manifest["device_runtime"] = device_runtime
    if plan.split.privacy is not None:  # the DP parameters of the round as written
        manifest["privacy"] = plan.split.privacy
    for rel, data in sorted(files.items()):
        (out / rel).write_bytes(data)
        manifest["files"][rel] = {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}
    # The manifest goes last: a bundle without one is incomplete.
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    return out


# --- reading and running -----------------------------------------------------------------


class Bundle:
    """A bundle read from disk, its files checked against the manifest."""

    def __init__(self, directory):
        self.dir = pathlib.Path(directory)
        path = self.dir / "manifest.json"
        if not path.is_file():
            raise BundleError(f"{self.dir} is not a production bundle: no manifest.json")
        try:
            self.manifest = json.loads(path.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise BundleError(f"{path}: unreadable manifest: {e}") from None
        if not isinstance(self.manifest, dict) or self.manifest.get("format") != FORMAT:
            raise BundleError(f"{path}: not an {FORMAT} manifest")
        version = self.manifest.get("format_version")
        if not isinstance(version, int) or version > FORMAT_VERSION:
            raise BundleError(
                f"{path}: bundle format version {version!r}; this fcir reads version "
                f"{FORMAT_VERSION} and older"
            )
        self._cache: dict[str, bytes] = {}
        self._compiled: dict[str, object] = {}

    def read(self, rel: str) -> bytes:
        if rel in self._cache:
            return self._cache[rel]
        entry = self.manifest.get("files", {}).get(rel)
        if entry is None:
            raise BundleError(f"{self.dir}: the manifest lists no file {rel}")
        try:
            data = (self.dir / rel).read_bytes()
        except OSError as e:
            raise BundleError(f"{self.dir}: cannot read {rel}: {e}") from None
        if hashlib.sha256(data).hexdigest() != entry.get("sha256"):
            raise BundleError(
                f"{self.dir}/{rel}: sha256 does not match the manifest (corrupt or modified bundle)"
            )
        self._cache[rel] = data
        return data

    def round(self) -> Module:
        return Module.deserialize(self.read("round.pb"))

    def artifact(self, part: str):

        rel = self.manifest["parts"][part]["files"]["stablehlo"]
        try:
            return lowering.load_artifact(self.read(rel))
        except BundleError:
            raise
        except ImportError as e:  # jax.export's serialization needs flatbuffers
            raise BundleError(f"reading {rel} needs jax.export serialization: {e}") from None
        except Exception as e:  # noqa: BLE001  (flatbuffers raises assorted errors)
            raise BundleError(f"{self.dir}/{rel}: not a jax.export artifact: {e}") from None

    def compiled(self, part: str):
        """``part``'s artifact compiled once for its own argument types (``jax.jit`` of
        ``Exported.call``, ahead of time): an eager ``Exported.call`` re-dispatches the
        whole module on every call, ~20x slower per client than the compiled function."""
        if part not in self._compiled:
            exported = self.artifact(part)
            specs = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in exported.in_avals]
            self._compiled[part] = jax.jit(exported.call).lower(*specs).compile()
        return self._compiled[part]

    def device_module(self, part: str, target: str | None = None):
        """``part``'s IREE module for this host (or ``target``), loaded."""
        entry = self.manifest["parts"][part].get("iree")
        if entry is None:
            raise BundleError(
                f"{self.dir}: {part} has no IREE modules: export the bundle with "
                "--device-runtime iree"
            )
        try:
            chosen = iree_runtime.pick_target(entry["modules"], entry["host_arch"], target)
        except iree_runtime.DeviceRuntimeError as e:
            raise BundleError(f"{self.dir}: {e}") from None
        try:
            return iree_runtime.Module(self.read(entry["modules"][chosen]["file"]))
        except ImportError as e:
            raise BundleError(
                f"--device-runtime iree needs iree-base-runtime: {e} (pip install -e "
                "'.[iree]' in the fcir checkout, or pip install 'iree-base-runtime>=3.13,<3.14')"
            ) from None
        except iree_runtime.DeviceRuntimeError as e:
            raise BundleError(f"{self.dir}: {part} ({chosen}): {e}") from None

    def run_flat(self, leaves: list, device_runtime: str = "jax") -> list:
        """Runs the round on its flat argument leaves; returns its flat result leaves.

        ``device_runtime="iree"``: client work runs as the bundle's IREE module (what a
        device without jax runs), the other parts under jax."""
        if device_runtime not in ("jax", "iree"):
            raise BundleError(f"device runtime {device_runtime!r}: choose jax or iree")
        m = self.manifest
        inputs = m["inputs"]
        if len(leaves) != len(inputs):
            raise BundleError(
                f"bundle @{m['round']} takes {len(inputs)} argument leaves, got {len(leaves)}"
            )
        env: dict[tuple[str, str], object] = {}
        for entry, x in zip(inputs, leaves):
            x = as_input(x)  # float64 numpy -> float32, as on every backend
            want = entry["runtime"]
            got = f"{dtype_name(x.dtype)}[{','.join(str(d) for d in np.shape(x))}]"
            if got != want:
                raise BundleError(
                    f"argument leaf {entry['leaf']} ({entry['type']}) needs an "
                    f"array of {want}, got {got}"
                )
            env[("arg", str(entry["leaf"]))] = x
        clients = m["placements"][0][1] if m["placements"] else 0
        for part in PARTS:
            spec = m["parts"][part]
            params = [env[(p["group"], p["name"])] for p in spec["params"]]
            keys = [(r["group"], r["name"]) for r in spec["results"]]
            if not keys:
                continue
            if part == "client_work" and device_runtime == "iree":
                fn = self.device_module(part)
                rows = [np.asarray(x) for x in params]
                per_client = [fn(*(x[i] for x in rows)) for i in range(clients)]
                outs = [np.stack([row[j] for row in per_client]) for j in range(len(keys))]
                env.update(zip(keys, outs))
                continue
            fn = self.compiled(part)
            if part == "client_work":
                per_client = [fn(*(x[i] for x in params)) for i in range(clients)]
                outs = [jax.numpy.stack([row[j] for row in per_client]) for j in range(len(keys))]
            else:
                outs = list(fn(*params))
            env.update(zip(keys, outs))
        return [env[("output", str(i))] for i in range(len(m["outputs"]))]


def run_bundle(directory, *args):
    """Runs the bundle in ``directory`` on pytree ``args``; returns the output pytree.

    Needs nothing but the bundle: the parts' jax.export artifacts are played in
    DistributeAggregateForm order (client work once per client).
    """
    bundle = Bundle(directory)
    outs = bundle.run_flat(jax.tree_util.tree_leaves(args))
    # In the process that captured the round, its own pytree classes (fcir.frontend.pytrees).
    return pytrees.unflatten_results(bundle.round().main, outs)
