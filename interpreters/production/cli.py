"""``fcir export --target production`` and ``fcir run-plan``: registered into the ``fcir``
command line by ``fcir.cli`` (``register(subparsers)``)."""

from __future__ import annotations

import json
from collections.abc import Callable

from fcir import argtable
from fcir.argtable import Command, option
from fcir.errors import FcirError
from fcir.frontend.loading import load_inputs, load_module

from . import export
from .bundle import Bundle
from .computation import AGGREGATE_WITH

#: ``fcir export --target NAME`` -> what exports a loaded round for it: ``fn(module, args)``
#: returning the exit status. A backend built on this one adds its target from its own
#: ``register`` (``add_export_target``: flower does), so production imports none of them.
EXPORT_TARGETS: dict[str, Callable] = {}
# --device-target choices (interpreters/production/iree_runtime.py ARCH, without importing it)
DEVICE_TARGETS = ("llvm-cpu", "x86_64-linux", "aarch64-linux-android34", "aarch64-apple-ios17")


def register(subparsers) -> None:
    """Adds the ``export`` and ``run-plan`` subcommands."""
    argtable.add(subparsers, EXPORT)
    argtable.add(subparsers, RUN_PLAN)


def add_export_target(name: str, export_fn: Callable) -> None:
    """Makes ``fcir export --target name`` call ``export_fn(module, args)``."""
    EXPORT_TARGETS[name] = export_fn


def cmd_export(a) -> int:
    return EXPORT_TARGETS[a.target](load_module(a.IN, a.args), a)


def export_production(module, a) -> int:
    """``fcir export --target production``: a DistributeAggregateForm bundle."""
    if a.device_target and a.device_runtime != "iree":
        raise FcirError("--device-target goes with --device-runtime iree")
    if a.inputs and a.device_runtime != "iree":
        raise FcirError(
            "--inputs goes with --target flower, or with --device-runtime iree (to verify "
            "the modules on them); a production bundle takes none"
        )
    plan = export(module, aggregate_with=a.aggregate_with)
    inputs = load_inputs(a.inputs, module) if a.inputs else None
    out = plan.write(
        a.output,
        device_runtime=a.device_runtime,
        device_targets=a.device_target or (),
        inputs=inputs,
    )
    print(f"@{module.name}: {plan.round_signature()}")
    for name in plan.parts:
        print(f"  {name:<29} {plan.signature(name)}")
    client = json.loads((out / "manifest.json").read_text())["parts"]["client_work"]
    if "iree" in client:
        e = client["iree"]
        print(f"  client_work as IREE modules ({e['opt_level']}): {', '.join(e['modules'])}")
    print(f"wrote production bundle to {out}")
    return 0


add_export_target("production", export_production)


def cmd_run_plan(a) -> int:
    import numpy as np

    bundle = Bundle(a.DIR)
    leaves = bundle.run_flat(load_inputs(a.inputs, bundle.round()), device_runtime=a.device_runtime)
    structure = bundle.round().main.result_structure
    order = structure.leaves() if structure is not None else range(len(leaves))
    outs = [np.asarray(leaves[i]) for i in order]
    if a.output:
        np.savez(a.output, *outs)
        print(f"wrote {len(outs)} output array(s) to {a.output}")
        return 0
    for i, x in enumerate(outs):
        flat = x.reshape(-1)
        preview = np.array2string(flat[:6], precision=6, separator=", ")
        more = " ..." if flat.size > 6 else ""
        print(f"arr_{i}: {x.dtype}{list(x.shape)} {preview}{more}")
    return 0


# --- the command line -------------------------------------------------------------------

EXPORT = Command(
    "export",
    help="export a round for production (DistributeAggregateForm bundle)",
    description="Split one federated round into the five DistributeAggregateForm parts "
    "and write a production bundle: the round as a federated_language Computation, "
    "each part as a jax.export StableHLO artifact and an XLA HloModuleProto, the fcir "
    "IR, and a manifest with versions and sha256 of every file. Exits 1 with a one-line "
    "reason when the round is not exportable.",
    epilog="Example: fcir export --target production round.fcir -o bundle/",
    options=(
        option(
            "--target",
            choices=EXPORT_TARGETS,  # read when the command line is parsed: every target added
            required=True,
            help="what to export for: 'production' (TFF / federated_language bundle) or "
            "'flower' (a Flower app directory that 'flwr run APPDIR FEDERATION' runs)",
        ),
        option(
            "IN",
            help="the round: an IR file (.fcir text, .pb binary), file.py:function "
            "or package.module:function",
        ),
        option(
            "-o",
            "--output",
            required=True,
            metavar="DIR",
            help="directory to write the bundle (or the Flower app) into",
        ),
        option(
            "--inputs",
            metavar="IN.npz",
            help="--target flower: the server's initial inputs (server argument leaves, "
            "arr_0, arr_1, ... in leaf order), embedded in the app; --target production "
            "with --device-runtime iree: the round's argument leaves (as run-plan takes "
            "them), on which the IREE modules are verified besides seeded inputs",
        ),
        option(
            "--device-runtime",
            choices=("jax", "iree"),
            default="jax",
            help="what runs client work on the devices: 'jax' (default; jax.export "
            "artifacts, nodes install jax) or 'iree' (modules compiled by IREE at export "
            "and verified against XLA; nodes install only numpy and iree-base-runtime)",
        ),
        option(
            "--device-target",
            action="append",
            choices=DEVICE_TARGETS,
            metavar="T",
            help="with --device-runtime iree, a target to compile client work for; repeat "
            "for several: llvm-cpu (default: this host's CPU), x86_64-linux, "
            "aarch64-linux-android34, aarch64-apple-ios17",
        ),
        option(
            "--args",
            nargs="+",
            metavar="SPEC",
            help="argument types of a Python target in IR syntax, one per argument, "
            "e.g. 'f32[16,1]' '(f32[8,32,16], f32[8,32,1])'; default: the file's "
            "EXAMPLE_ARGS",
        ),
        option(
            "--aggregate-with",
            choices=AGGREGATE_WITH,
            default="intrinsics",
            help="'intrinsics' (default): one intrinsic per reduction; "
            "'federated_aggregate': sums and means as federated_aggregate with XLA "
            "zero/accumulate/merge/report, for runtimes that implement only that",
        ),
    ),
    func=cmd_export,
)
RUN_PLAN = Command(
    "run-plan",
    help="run a production bundle on inputs (needs only the bundle)",
    description="Run a bundle written by 'fcir export --target production': its five "
    "parts in DistributeAggregateForm order, client work once per client. IN.npz holds "
    "the round's flattened argument leaves as arr_0, arr_1, ... (np.savez(*leaves)); "
    "OUT.npz gets the output leaves the same way. Without -o, prints a summary.",
    epilog="Example: fcir run-plan bundle/ --inputs in.npz -o out.npz",
    options=(
        option("DIR", help="the bundle directory"),
        option(
            "--inputs",
            required=True,
            metavar="IN.npz",
            help="flattened argument leaves (arr_0, arr_1, ...)",
        ),
        option("-o", "--output", metavar="OUT.npz", help="where to write the output leaves"),
        option(
            "--device-runtime",
            choices=("jax", "iree"),
            default="jax",
            help="run client work as the bundle's jax.export artifact (default) or as its IREE "
            "module (a bundle exported with --device-runtime iree)",
        ),
    ),
    func=cmd_run_plan,
)
