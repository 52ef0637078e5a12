"""``fed.max``: the elementwise maximum over the members."""

from __future__ import annotations

from fcir import primitives as P

from .base import Reduction


class Max(Reduction):
    """Elementwise maximum over members: ``{T}@child -> T``."""

    name = "fed.max"
    primitive = P.max_p
