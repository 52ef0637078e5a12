"""Genuinely wrong IREE modules for the verification tests: at chosen optimization levels
``compile_module`` builds, with IREE, the module of the part's code with every float
result scaled by 1.001 (same signature, runs fine, numbers 1e-3 off: far outside rtol
1e-5), while XLA's reference stays the true code."""

from __future__ import annotations

import jax.numpy as jnp


def wrong_at(monkeypatch, levels, targets=None) -> list:
    """Wrong modules at ``levels`` (for ``targets`` only, when given); returns the
    levels compiled, in order."""
    from fcir.interpreters.production import iree

    real_export, real_compile = iree.cpu_export, iree.compile_module
    wrong_code: dict[str, bytes] = {}
    seen: list[str] = []

    def cpu_export(fn, specs):
        def wrong(*args):
            return tuple(
                y * jnp.asarray(1.001, y.dtype) if jnp.issubdtype(y.dtype, jnp.floating) else y
                for y in fn(*args)
            )

        wrong_code["stablehlo"] = bytes(real_export(wrong, specs).mlir_module_serialized)
        return real_export(fn, specs)

    def compile_module(stablehlo, target, level, extra_flags=()):
        seen.append(level)
        wrong = level in levels and (targets is None or target in targets)
        code = wrong_code["stablehlo"] if wrong else stablehlo
        return real_compile(code, target, level, extra_flags)

    monkeypatch.setattr(iree, "cpu_export", cpu_export)
    monkeypatch.setattr(iree, "compile_module", compile_module)
    return seen
