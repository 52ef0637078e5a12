"""XLA:CPU's cheapest compile, for the tests whose compared sides are compiled alike or
compared within a tolerance (docs/contributing.md, CI): what they check does not depend
on how the kernels are generated, and compiling is most of what they cost.

``options()`` are compile options (``lowered.compile(options())``, ``jax.jit(...,
compiler_options=options())``) and ``flags()`` the same as ``XLA_FLAGS`` words for a child
process: LLVM at -O0 without its expensive passes, and, where this XLA has the option
(jaxlib 0.10; later ones dropped it), its older fusion emitters instead of the MLIR
ones, which cost most of a -O0 compile there: the transformer round's gradient 5.1 ->
1.8 CPU s on jax 0.10.2. The bitwise checks that compare with XLA's defaults on purpose
(fcir against ``jax.jit`` as users compile it) do not use this.
"""

from __future__ import annotations

import functools
import sys

LEVEL_0 = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}
_LEGACY_EMITTERS = {"xla_cpu_use_fusion_emitters": False}


@functools.cache
def _has_legacy_emitters() -> bool:
    """Whether this XLA takes ``xla_cpu_use_fusion_emitters`` (an unknown option is an
    error, an unknown XLA_FLAGS word kills the process): one trivial compile tells."""
    import jax

    try:
        jax.jit(lambda: 0).lower().compile(_LEGACY_EMITTERS)
    except Exception:  # noqa: BLE001  (XlaRuntimeError: "No such compile option")
        return False
    return True


def options() -> dict:
    """The compile options (see above)."""
    return {**LEVEL_0, **(_LEGACY_EMITTERS if _has_legacy_emitters() else {})}


def flags() -> list[str]:
    """The same as XLA_FLAGS words; without JAX imported (a scratch suite's parent), the
    -O0 words only."""
    return words(options() if "jax" in sys.modules else LEVEL_0)


def words(opts: dict) -> list[str]:
    """Compile options as XLA_FLAGS words."""
    return [f"--{k}={str(v).lower()}" for k, v in opts.items()]
