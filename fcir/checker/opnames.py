"""The names an IR op may carry, and the one did-you-mean for a name no op has."""

from __future__ import annotations

import difflib

from fcir.fed.base import FedOp

#: The ops fcir itself defines outside ``fed.*`` and ``jax.*`` (op/C0).
FCIR_OPS = ("fcir.constant",)


def closest_op(name: str, more: tuple[str, ...] = ()) -> str:
    """`` (did you mean 'fed.broadcast'?)`` for an op name no op has, or ``""``: the one
    suggestion of the checker (fed/C0, op/C0) and of ``@fcir.impl``. ``fed.*`` and
    ``fcir.*`` are matched against their closed sets; any other name against both and
    ``more`` (a caller that knows JAX's primitives adds the one it found)."""
    fed = sorted(FedOp.registry)
    if name.startswith("fed."):
        known = fed
    elif name.startswith("fcir."):
        known = list(FCIR_OPS)
    else:
        known = [*fed, *FCIR_OPS, *more]
    near = difflib.get_close_matches(name, known, n=1, cutoff=0.6)
    return f" (did you mean {near[0]!r}?)" if near else ""
