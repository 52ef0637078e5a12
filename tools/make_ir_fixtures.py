"""Writes the IR compatibility fixtures: every corpus program as fcir wrote it.

    python tools/make_ir_fixtures.py            # writes tests/fixtures/ir_v<N>_jax<V>/

For each corpus program (and the gradients pinned by goldens) it captures the program
with the running fcir and JAX and saves, under ``tests/fixtures/ir_v<ir_version>_jax<jax
version>/``:

- ``<name>.fcir``  canonical text with full constants (``to_text(full_constants=True)``)
- ``<name>.pb``    the serialized ``fcir.v1.Module``
- ``<name>.inputs.npz``   the flat argument leaves (``a0``, ``a1``, ...); key arrays are
  stored as their key data, with the PRNG implementation named in ``manifest.json``
- ``<name>.outputs.npz``  the reference interpreter's flat result leaves (``r0``, ...)

plus ``manifest.json`` (fcir/JAX versions, per program its leaf kinds). The set checked
in was written by fcir main at commit 4767b94 under jax/jaxlib 0.10.2, Python 3.11
(``.venv311/bin/python tools/make_ir_fixtures.py``), *before* fcir's own op schema: it is
what "IR written by an earlier fcir under JAX 0.10.2" means in tests/ir/test_ir_fixtures.py,
which loads these files under the running JAX, checks them and compares the numbers.
Never regenerate that directory; a newer fcir writes a new one next to it.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

import jax
import numpy as np

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

GRADIENTS = ("fedavg_mlp", "fedavg_transformer", "diloco", "scan_rounds")


def _programs():
    from corpus import CASES

    for c in CASES:
        yield c.name, c.fn, c.make_args()
    for name in GRADIENTS:
        c = next(x for x in CASES if x.name == name)
        grad = jax.grad(lambda *a, c=c: c.loss(c.fn(*a)), c.grad_argnums)
        yield f"{name}_grad", grad, c.make_args()


def _store(prefix: str, leaves) -> tuple[dict, list]:
    """Leaves as npz entries plus, per leaf, its kind (array, or key with its impl)."""
    arrays, kinds = {}, []
    for i, x in enumerate(leaves):
        if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
            arrays[f"{prefix}{i}"] = np.asarray(jax.random.key_data(x))
            kinds.append({"key": str(jax.random.key_impl(x))})
        else:
            arrays[f"{prefix}{i}"] = np.asarray(x)
            kinds.append({"array": str(np.asarray(x).dtype)})
    return arrays, kinds


def main(argv=None) -> int:
    from fcir.interpreters import reference

    import fcir

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=pathlib.Path, default=None, help="output directory")
    ns = parser.parse_args(argv)
    out = ns.out or ROOT / "tests" / "fixtures" / f"ir_v{fcir.IR_VERSION}_jax{jax.__version__}"
    out.mkdir(parents=True, exist_ok=True)
    manifest = {
        "ir_version": fcir.IR_VERSION,
        "jax": jax.__version__,
        "python": sys.version.split()[0],
        "programs": {},
    }
    for name, fn, args in _programs():
        module = fcir.capture(fn, *args, name=name)
        fcir.check(module)
        (out / f"{name}.fcir").write_text(module.to_text(full_constants=True))
        (out / f"{name}.pb").write_bytes(module.serialize())
        leaves = jax.tree.leaves(args)
        results = jax.tree.leaves(reference.run(module, *leaves))
        ins, in_kinds = _store("a", leaves)
        outs, out_kinds = _store("r", results)
        np.savez(out / f"{name}.inputs.npz", **ins)
        np.savez(out / f"{name}.outputs.npz", **outs)
        manifest["programs"][name] = {"inputs": in_kinds, "outputs": out_kinds}
        print(f"{name}: {len(leaves)} inputs, {len(results)} outputs")
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")
    print(f"wrote {out.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
