"""``fcir run --backend reference``: the reference interpreter, run from the command
line (the ``fcir.backends`` entry point ``reference``)."""

from __future__ import annotations

from fcir.interpreters import reference

STREAMS = False  # one Python step per member; no --clients-per-step


def run_program(module, args, clients_per_step=None):
    """The outputs of ``module`` on ``args``, run by the reference interpreter."""
    return reference.run(module, *args)
