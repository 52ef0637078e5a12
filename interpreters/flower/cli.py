"""``fcir export --target flower`` (dispatched from the export command) and
``fcir flower up`` (a local SuperLink and SuperNodes to run exported apps on)."""

from __future__ import annotations

from fcir.errors import FcirError


def cmd_export_flower(module, a) -> int:
    from fcir.interpreters.production.cli import _read_npz

    from . import export

    inputs = _read_npz(a.inputs) if a.inputs else None
    if a.aggregate_with != "intrinsics":
        raise FcirError("--aggregate-with is for --target production; a Flower app aggregates itself")
    out = export(module, a.output, inputs=inputs)
    print(f"@{module.name}: wrote Flower app to {out}")
    print(f"run it: flwr run {out} FEDERATION --run-config 'rounds=1 output=\"/abs/out.npz\"'")
    return 0
