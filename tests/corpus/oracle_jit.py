"""``oracle_jit``: how oracles compile their per-member and server steps.

An oracle runs once on tiny inputs, so compiling is nearly all of its cost, and LLVM's
optimization passes are about half of compiling. Skipping them changes no operation's
semantics; results may differ from the optimized build in the last bit (no fused
multiply-adds), well inside the corpus tolerance. The bf16 case keeps plain
``jax.jit``: one bit in float32 can flip a bfloat16 rounding.
"""

from __future__ import annotations

import functools

import jax

oracle_jit = functools.partial(jax.jit, compiler_options={"xla_backend_optimization_level": 0})
