"""``fed.min``: the elementwise minimum over the members."""

from __future__ import annotations

from fcir import primitives as P

from .base import Reduction


class Min(Reduction):
    """Elementwise minimum over members: ``{T}@child -> T``."""

    name = "fed.min"
    primitive = P.min_p
