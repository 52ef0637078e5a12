"""``oracle_jit``: how oracles compile their per-member and server steps.

An oracle runs once on tiny inputs, so compiling is nearly all of its cost, and LLVM's
optimization passes are about half of compiling. Called with concrete arrays, a step
skips them: that changes no operation's semantics, and results may differ from the
optimized build only in the last bit (no fused multiply-adds), well inside the corpus
tolerance. Traced (under ``jax.grad``, ``jax.jit``, ...) a step is a plain ``jax.jit``,
because XLA compiler options are only allowed on an outermost jit. The bf16 case keeps
plain ``jax.jit``: one bit in float32 can flip a bfloat16 rounding.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax

_FAST_COMPILE = {"xla_backend_optimization_level": 0}


def oracle_jit(fn: Callable) -> Callable:
    plain = jax.jit(fn)
    fast = jax.jit(fn, compiler_options=_FAST_COMPILE)

    @functools.wraps(fn)
    def call(*args):
        traced = any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves(args))
        return (plain if traced else fast)(*args)

    return call
