"""A production Plan -> a Flower app directory (ServerApp + ClientApp + pyproject.toml).

Layout of APPDIR::

    pyproject.toml           the Flower app: components, dependencies, run config defaults
    fcir_app/                the app's package (copied from fcir.interpreters.flower.app)
        server_app.py        ServerApp: server parts, sampling, aggregation, checkpoints
        client_app.py        ClientApp: client work from its jax.export artifact
        runtime.py           shared by both: artifacts, arrays on the wire, aggregations
        evaluation.py        Flower's evaluate stage, for a program with an evaluation
        plan.json            the round's phases: which part runs where, on which values;
                             for a round with DP ops, its privacy parameters
        artifacts.json       the parts' jax.export artifacts (base64, sha256)
        inputs.json          the server's initial inputs, when given at export

The directory is written next to its destination under a temporary name and renamed
into place, so a failed export leaves nothing behind, and an existing APPDIR is
replaced only by a complete app.
"""

from __future__ import annotations

import base64
import functools
import hashlib
import json
import os
import pathlib
import shutil
import tempfile

import numpy as np

from fcir import fed as F
from fcir.errors import ExportError
from fcir.frontend.loading import leaf_paths as paths
from fcir.frontend.pytrees import leaf_names as leaf_names_of
from fcir.ir.types import runtime_type
from fcir.privacy.keys import key_arguments

from ..production import dp
from ..production import export as production_export
from ..production.ddp import mechanism
from ..production.iree import client_modules
from ..production.rewrite import member_type
from ..production.splitting import PARTS, part_interface
from .loops import find_loop, loop_plan
from .phases import server_aggregate, split_phases

APP_PACKAGE = "fcir_app"
FORMAT = "fcir.flower.app"
FORMAT_VERSION = 1
FAB_LIMIT = 10 * 1024 * 1024  # flwr.common.constant.FAB_MAX_SIZE
SOURCES = (
    "__init__.py",
    "runtime.py",
    "secagg.py",
    "server_app.py",
    "client_app.py",
    "training.py",
    "program.py",
    "evaluation.py",
    "partitions.py",
)
# Copied from production's folder into every app: the table of intrinsics the plan's
# aggregations name (runtime.py computes them with it).
PRODUCTION_SOURCES = ("intrinsics.py",)
# Only in --device-runtime iree apps: the device side of production bundles' client work
# (fcir.interpreters.production.iree_runtime), copied from production's folder.
IREE_SOURCES = ("iree_runtime.py",)

# Run config keys and their defaults (flwr run --run-config overrides only declared keys).
# Flower's FedAvg keys with its defaults (fraction-*, min-*-nodes), then fcir's own.
RUN_CONFIG = {
    "num-server-rounds": 1,
    "fraction-train": 1.0,
    "fraction-evaluate": 1.0,
    "min-train-nodes": 2,
    "min-evaluate-nodes": 2,
    "min-available-nodes": 2,
    "output": "",
    "inputs": "",
    "state": "",
    "metrics": "",
    "checkpoint-dir": "",
    "clients": 0,
    "timeout": 600.0,
    "secagg": True,
    "data-dir": "",
    "metrics-file": "",
    "max-epsilon": "",  # none: no privacy budget
    # A data set each node partitions as flwr-datasets does (client_app.partition_data).
    "dataset": "",
    "dataset-fields": "",
    "partitioner": "iid",
    "partition-by": "label",
    "alpha": 0.5,
    "num-classes-per-partition": 2,
    "partition-seed": 42,
}


def _spec(t, index, path: str | None = None) -> dict:
    spec = {"leaf": index, "type": str(t), "dtype": t.np_dtype.name, "shape": list(t.shape)}
    if path is not None:
        spec["path"] = path
    return spec


def leaf_paths(structure, n: int) -> dict[int, str]:
    """Flat index -> its pytree path in ``structure`` (``[0]['w']``, as jax.tree_util.keystr
    writes it; ``fcir.frontend.loading.leaf_paths``); ``[i]`` for a function without a recorded
    structure."""
    return dict(enumerate(paths(structure, n)))


def _phase_steps(plan, phase, k: int, multi: bool, device=None) -> tuple[list, dict[str, bytes]]:
    """Phase ``k``'s steps (server_prepare, the exchange, server_result) and artifacts.

    With several phases, each phase's groups are prefixed ``<k>.`` (its own values),
    carried values are ``("carry", name)`` and the round's arguments stay ``("arg", i)``.
    """
    sp = plan.split
    interface = part_interface(plan)
    stablehlo = plan.stablehlo_artifacts()
    n_args = len(phase.module.main.body.params) - len(phase.carried_in)

    def key(pair):
        g, n = pair
        if g == "arg":
            i = int(n)
            return ["arg", n] if i < n_args else ["carry", phase.carried_in[i - n_args]]
        if g == "output" and phase.carried_out:
            return ["carry", phase.carried_out[int(n)]]
        if g == "output" or not multi:
            return [g, n]
        return [f"{k}.{g}", n]

    def art(name):
        return f"{k}.{name}" if multi else name

    def part(name):
        ps, rs = interface[name]
        return {
            "artifact": art(name),
            "params": [key(x) for x in ps],
            "results": [key(x) for x in rs],
        }

    sends = [key(src) for src in interface["server_to_client_broadcast"][0]]
    steps = [
        {"kind": "server", "part": part("server_prepare")},
        {
            "kind": "exchange",
            # broadcast_input -> broadcast_output is the identity (the transport).
            "send": [[src, key(("broadcast_output", src[1]))] for src in sends],
            "client": part("client_work"),
            "aggregations": [
                {
                    "fed_op": a.fed_op,
                    "inputs": list(a.inputs),
                    "output": a.output,
                    "bitwidth": a.bitwidth,
                    **({"attrs": dict(a.attrs)} if a.attrs else {}),
                    **server_aggregate(a),
                }
                for a in sp.aggregations
            ],
            "aggregated": f"{k}.aggregated" if multi else "aggregated",
            **_min_replies(phase.module),
        },
        {"kind": "server", "part": part("server_result")},
    ]
    artifacts = {
        art(name): stablehlo[name][0] for name in PARTS if name != "server_to_client_broadcast"
    }
    if device is not None:  # --device-runtime iree: verified modules replace the artifact
        targets, given = device
        steps[1]["client"], artifacts = client_modules(
            plan, art("client_work"), steps[1]["client"], artifacts, targets, given
        )
    return steps, artifacts


def _min_replies(module) -> dict:
    """``{"min_replies": m, "min_replies_why": text}``: the fewest replies the exchange's
    aggregations are defined for, and why, or ``{}``. A distributed DP release needs
    its ``min_clients`` noise shares (the cardinality where an op declares none):
    fewer would sum less noise than the accountant assumed (docs/privacy.md,
    "Dropouts"); a robust aggregate needs its op's ``min_replies`` (Bulyan: 4f + 3).
    The ServerApp refuses an exchange with fewer; ``flower.Strategy`` skips the round,
    as Flower's own ``Bulyan`` does."""
    need = []
    for op in module.main.body.ops:
        cls = F.op_class(op)
        if cls is None or cls.kind not in ("reduction", "ddp"):
            continue
        if cls.kind == "ddp":
            m = op.attrs.get("min_clients") or module.cardinality(op.operands[0].type.placement)
            why = (
                f"the distributed DP release (fed.ddp_*) needs the noise shares of at least "
                f"{m} clients (its min_clients): fewer would carry less noise than its "
                "epsilon assumes"
            )
        else:
            m = cls.min_replies(op.attrs)
            attrs = ", ".join(f"{k}={v}" for k, v in sorted(op.attrs.items()))
            why = f"{op.name} ({attrs}) is defined over at least {m} clients"
        if m > 1:
            need.append((m, why))
    if not need:
        return {}
    m, why = max(need, key=lambda e: e[0])
    return {"min_replies": m, "min_replies_why": why}


def build_plan(module, device_targets=None, server_inputs=None) -> tuple[dict, dict[str, bytes]]:
    """The app's plan.json and its artifacts (key -> bytes) for a round: one phase per
    broadcast/aggregate exchange, each split by the production export.

    ``device_targets`` (a list, for ``--device-runtime iree``): client work as IREE
    modules for those targets instead of jax.export artifacts, verified on
    the server's inputs too when given (the first phase's: later ones take carried
    values)."""
    at = find_loop(module)
    if at is not None:  # a whole training program: one Flower round per iteration
        rounds = functools.partial(build_plan, device_targets=device_targets)
        given = server_inputs if device_targets is not None else None  # to verify on
        return loop_plan(module, at, rounds, _spec, leaf_paths, given)
    phases = split_phases(module)
    multi = len(phases) > 1
    steps, artifacts, plans = [], {}, []
    for k, phase in enumerate(phases, 1):
        plan = production_export(phase.module)
        plans.append(plan)
        device = None
        if device_targets is not None:
            leaves = [i for i in sorted(plan.split.server_args) if i < len(module.main.body.params)]
            given = None
            if k == 1 and server_inputs is not None and len(leaves) == len(server_inputs):
                given = dict(zip(leaves, server_inputs))
            device = (device_targets, given)
        s, a = _phase_steps(plan, phase, k, multi, device)
        steps += s
        artifacts.update(a)
    first = plans[0].split
    params = module.main.body.params
    member = first.client_member.main.body.params
    client_inputs = [
        _spec(member_type(member[k].type), leaf) for k, leaf in enumerate(first.client_args)
    ]
    arg_paths = leaf_paths(module.main.arg_structure, len(params))
    server_inputs = [
        _spec(runtime_type(params[i].type, module.cardinality), i, arg_paths.get(i))
        for i in sorted(first.server_args)
        if i < len(params)
    ]
    results = module.main.body.results
    result_paths = leaf_paths(module.main.result_structure, len(results))
    outputs = [
        _spec(runtime_type(v.type, module.cardinality), i, result_paths.get(i))
        for i, v in enumerate(results)
    ]
    # The program's own names (dict keys, namedtuple fields) for the log lines and the
    # metrics; a leaf without one is logged by its output position.
    for spec, name in zip(outputs, leaf_names_of(module.main.result_structure, len(results))):
        if not name.startswith("arr_"):
            spec["name"] = name
    structure = module.main.result_structure
    order = structure.leaves() if structure is not None else list(range(len(results)))
    doc = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "round": module.name,
        "signature": plans[-1].round_signature() if not multi else f"{len(phases)} phases",
        "bundle_clients": module.placements[0][1] if module.placements else 0,
        "server_inputs": server_inputs,
        "client_inputs": client_inputs,
        "outputs": outputs,
        "output_order": order,
        "steps": steps,
    }
    if device_targets is not None:
        doc["device_runtime"] = "iree"
    privacy = _privacy(module)
    if privacy is not None:
        doc["privacy"] = privacy
    return doc, artifacts


def evaluation_plan(evaluation, doc: dict) -> tuple[dict, dict[str, bytes]]:
    """plan.json's ``evaluate``: the evaluation's one exchange, its artifacts under
    ``evaluate.``; its server inputs must be the round's first server inputs (the model
    the round updates), type for type."""
    plan, artifacts = build_plan(evaluation)
    kinds = [s["kind"] for s in plan.get("steps", ())]
    if "loop" in plan or kinds != ["server", "exchange", "server"]:
        raise ExportError(
            f"export --target flower: the evaluation @{evaluation.name} must be one exchange "
            "(fcir.evaluation(program) captured)"
        )
    ours, theirs = plan["server_inputs"], doc["server_inputs"]
    if [s["type"] for s in ours] != [s["type"] for s in theirs[: len(ours)]]:
        raise ExportError(
            f"export --target flower: the evaluation @{evaluation.name} takes server values "
            f"({', '.join(s['type'] for s in ours)}) that are not @{doc['round']}'s first "
            f"server inputs ({', '.join(s['type'] for s in theirs)}): evaluate the model the "
            "round trains"
        )
    for step in plan["steps"]:
        part = step.get("part") or step.get("client")
        part["artifact"] = f"evaluate.{part['artifact']}"
    return plan, {f"evaluate.{k}": v for k, v in artifacts.items()}


def _privacy(module) -> dict | None:
    """plan.json's ``privacy``: the production manifest's entry for the round as written
    (every phase's DP ops compose into one round's epsilon), and what a dp_mean divides
    by when clients drop out (docs/flower.md, Participation)."""
    entry = dp.manifest_entry(module)
    if entry is None:
        return None
    n = module.placements[0][1] if module.placements else 0
    return {
        **entry,
        "mechanism": mechanism(entry)
        or "Gaussian: each client's update clipped in "
        "client_work (on the device), summed by the ServerApp over the replies, noise added "
        "in server_result; client-level DP (add or remove one client)",
        # The noise is calibrated to the sum's sensitivity (one client's clip_norm). A
        # divisor fixed at export keeps the guarantee; dividing by the number of replies
        # would make the released value depend on who dropped out.
        "dp_mean_divisor": n,
        "participation": f"dp_mean divides the noised sum by the declared cardinality "
        f"({n}) however many sampled clients reply; epsilon_per_round assumes every client "
        "takes part and claims no amplification by sampling",
        # Per release, the arguments (server input leaves) its key may depend on: with
        # rounds > 1 the ServerApp refuses a key that no state-fed input changes.
        "keys": [
            {
                "op": op.name,
                "clip_norm": op.attrs["clip_norm"],
                "noise_multiplier": op.attrs["noise_multiplier"],
                "arguments": sorted(deps),
            }
            for op, deps in key_arguments(module)
        ],
        # The round itself, for the ServerApp's cumulative epsilon under the sampling it
        # uses (fcir.privacy.epsilon on the server, which has fcir; never read on a node).
        "ir": module.to_text(full_constants=True),
    }


def _jax_floor() -> str:
    """The exporting jax's release (``0.12.0`` of ``0.12.0.1``): the app's jax floor."""
    import jax

    return ".".join(jax.__version__.split(".")[:3])


def _check_replaceable(out: pathlib.Path) -> None:
    """An existing APPDIR is replaced whole, so it must be an app fcir wrote (its
    ``fcir_app/plan.json``) or an empty directory: ``-o .``, ``-o ~/project`` or
    ``-o round.fcir`` (the input file) would otherwise be deleted."""
    if not out.exists() and not out.is_symlink():
        return
    if out.is_dir() and not out.is_symlink():
        if (out / APP_PACKAGE / "plan.json").is_file() or not any(out.iterdir()):
            return
        what = "a directory that is not a Flower app fcir wrote (no fcir_app/plan.json)"
    else:
        what = "a file, not a directory"
    raise ExportError(
        f"export --target flower: {out} is {what}; the app would replace it whole: "
        "give -o a new or empty directory (or one an earlier export wrote)"
    )


def _pyproject(name: str, device_runtime: str = "jax") -> str:
    def value(v):
        return json.dumps(v) if isinstance(v, (str, bool)) else repr(v)  # TOML: true, "text"

    config = "\n".join(f'"{k}" = {value(v)}' for k, v in RUN_CONFIG.items())
    return f"""# A Flower app exported by fcir (fcir export --target flower). Run it with
#   flwr run . SUPERLINK --stream --run-config 'num-server-rounds=3'
# (the final outputs go to final_model.npz, or to output="/abs/out.npz"; with
# num-server-rounds > 1, outputs feed the server inputs of the same pytree path and type,
# or name the mapping with state="I=O,...": see docs/flower.md, Run config)
[build-system]
requires = ["hatchling"]
build-backend = "hatchling.build"

[project]
name = "{name}"
version = "1.0.0"
description = "fcir round @{name} as a Flower app"
license = "Apache-2.0"
{_DEPENDENCIES[device_runtime].replace("{JAX}", _jax_floor())}

[tool.hatch.build.targets.wheel]
packages = ["."]

[tool.flwr.app]
publisher = "fcir"

[tool.flwr.app.components]
serverapp = "{APP_PACKAGE}.server_app:app"
clientapp = "{APP_PACKAGE}.client_app:app"

[tool.flwr.app.config]
{config}
"""


_DEPENDENCIES = {
    "jax": """# A device needs jax and flwr, never fcir: client work is a jax.export artifact,
# which jax deserializes with flatbuffers (not one of jax's own dependencies). A jax
# reads artifacts serialized by its own and earlier versions, so the floor is the
# exporting jax.
dependencies = ["flwr==1.42.0", "jax>={JAX},<0.13", "numpy>=2.0", "flatbuffers>=24.3"]""",
    "iree": """# A device needs flwr, numpy and IREE's runtime, never jax nor fcir: client work is
# IREE modules. The ServerApp's host also needs jax (the server extra). ml_dtypes (which
# iree.runtime imports) 0.7.0 took ~2 s to import on numpy 2.4, 0.5/0.6 10-30 ms.
dependencies = [
  "flwr==1.42.0", "numpy>=2.0", "iree-base-runtime>=3.13,<3.14", "ml_dtypes>=0.5,<0.7",
]

[project.optional-dependencies]
server = ["jax>=0.10.2,<0.13"]""",
}


def write_app(
    module,
    directory,
    *,
    inputs: list | None = None,
    device_runtime: str = "jax",
    device_targets=(),
    evaluation=None,
) -> pathlib.Path:
    """Writes the Flower app of ``module`` to ``directory`` atomically (see the module doc).

    ``evaluation``: a captured ``fcir.evaluation(program)``, run in Flower's evaluate
    stage after each round (app/evaluation.py).

    ``inputs``: the server's initial inputs (server leaves, in leaf order), embedded
    as ``inputs.json``; without them the run config ``inputs=FILE`` must name them.
    """
    if device_runtime not in _DEPENDENCIES:
        raise ExportError(f"device runtime {device_runtime!r}: choose jax or iree")
    if device_targets and device_runtime != "iree":
        raise ExportError("--device-target goes with --device-runtime iree")
    iree = device_runtime == "iree"
    doc, artifacts = build_plan(module, list(device_targets) if iree else None, inputs)
    if evaluation is not None:
        doc["evaluate"], more = evaluation_plan(evaluation, doc)
        artifacts.update(more)
    if inputs is not None:
        specs = doc["server_inputs"]
        if len(inputs) != len(specs):
            raise ExportError(
                f"export --target flower: the inputs hold {len(inputs)} array(s); "
                f"@{doc['round']} takes {len(specs)} server input(s) "
                f"({', '.join(s['type'] for s in specs) or 'none'}): pass the server leaves only"
            )
        embedded = []
        for i, (x, s) in enumerate(zip(inputs, specs)):
            x = np.asarray(x)
            if x.dtype.name != s["dtype"] or list(x.shape) != s["shape"]:
                raise ExportError(
                    f"export --target flower: input arr_{i} is {x.dtype.name}{list(x.shape)}; "
                    f"server input leaf {s['leaf']} is {s['type']}"
                )
            embedded.append(
                {
                    "dtype": s["dtype"],
                    "shape": s["shape"],
                    "base64": base64.b64encode(np.ascontiguousarray(x).tobytes()).decode(),
                }
            )
    files: dict[str, str] = {
        "plan.json": json.dumps(doc, indent=1) + "\n",
        "artifacts.json": json.dumps(
            {
                k: {"sha256": hashlib.sha256(v).hexdigest(), "base64": base64.b64encode(v).decode()}
                for k, v in artifacts.items()
            }
        )
        + "\n",
    }
    if inputs is not None:
        files["inputs.json"] = json.dumps(embedded) + "\n"
    size = sum(len(v) for v in files.values())
    if size > FAB_LIMIT:
        raise ExportError(
            f"export --target flower: @{doc['round']}'s artifacts and inputs take "
            f"{size / 2**20:.1f} MiB as text, over Flower's 10 MiB app bundle limit: move large "
            "constants out of the program into its arguments"
        )
    out = pathlib.Path(directory).resolve()
    _check_replaceable(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = pathlib.Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        pkg = tmp / APP_PACKAGE
        pkg.mkdir()
        src = pathlib.Path(__file__).resolve().parent / "app"
        for name in SOURCES:
            shutil.copyfile(src / name, pkg / name)
        for name in (*PRODUCTION_SOURCES, *(IREE_SOURCES if iree else ())):
            shutil.copyfile(src.parent.parent / "production" / name, pkg / name)
        for name, text in files.items():
            (pkg / name).write_text(text)
        project = "fcir-" + doc["round"].replace("_", "-").lower()
        (tmp / "pyproject.toml").write_text(_pyproject(project, device_runtime))
        os.chmod(tmp, 0o755)
        if out.exists():
            old = out.with_name(f".{out.name}.old-{os.getpid()}")
            out.rename(old)
            tmp.rename(out)
            shutil.rmtree(old, ignore_errors=True)
        else:
            tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out
