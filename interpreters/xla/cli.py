"""``fcir run --backend xla`` and ``fcir compile --emit hlo,stablehlo,cost``: the XLA
backend, run from the command line (the ``fcir.backends`` entry point ``xla``)."""

from __future__ import annotations

import sys

from fcir.interpreters import xla
from fcir.interpreters.xla import format_cost  # noqa: F401  (fcir compile --emit cost)

STREAMS = True  # --clients-per-step K streams each fed.map K members at a time


def compile_program(module, mesh=None, clients_per_step=None):
    """``module`` compiled by XLA; with ``--clients-per-step auto``, says which k the
    memory analysis chose."""
    # Looked up at call time: xla.compile is what a test (or a user) wraps.
    exe = xla.compile(module, mesh=mesh, clients_per_step=clients_per_step)
    _say_chosen_k(exe)
    return exe


def run_program(module, args, clients_per_step=None):
    """The outputs of ``module`` on ``args``, compiled by XLA."""
    return compile_program(module, clients_per_step=clients_per_step)(*args)


def _say_chosen_k(exe) -> None:
    """With ``--clients-per-step auto``, which k the memory analysis chose (stderr, so
    printed IR or outputs stay clean)."""
    s = getattr(exe, "streaming", None)
    if not s or s.get("mode") != "auto":
        return
    tried = [f"k={k}: {int(b):,} B" for k, b in s.get("candidates", {}).items()]
    tried += [
        f"k={k}: out of memory" + ("" if b is None else f" ({int(b):,} B asked)")
        for k, b in s.get("out_of_memory", {}).items()
    ]
    tried = ", ".join(tried)
    print(
        f"clients-per-step auto: k={s['clients_per_step']} members per step and device "
        f"(predicted peak {int(s['predicted_peak_bytes']):,} B of a "
        f"{int(s['memory_limit_bytes']):,} B limit; tried {tried})",
        file=sys.stderr,
    )
