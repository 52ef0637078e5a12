"""Which local ops act member by member: the one list capture, the checker and the
streaming backend read.

``ELEMENTWISE``: JAX primitives applied elementwise whose params name no axis and no
shape. On values placed at one placement they are per-member computations, and run on
a chunk of members they mean the same as on all members. ``add_any`` is how JAX's
backward pass sums the cotangents of a placed value used twice; ``stop_gradient`` is
the identity (FedProx's anchor: ``stop_gradient(fcir.broadcast(w))``).

``LAYOUT``: ops that only change where a value lives. Under a mesh the frontend adds
them to placed values, which stay placed (capture, ``local/C2``); their params carry
the whole value's sharding, so a stream does not run them a chunk at a time: it reads
through them (one member's value has no member axis to lay out).

``PER_MEMBER`` is both: what keeps a placed value placed.
"""

from __future__ import annotations

__all__ = ["ELEMENTWISE", "LAYOUT", "PER_MEMBER"]

ELEMENTWISE = frozenset(
    """abs acos acosh add add_any and asin asinh atan atan2 atanh cbrt ceil clamp complex
    conj copy convert_element_type cos cosh digamma div eq erf erf_inv erfc exp exp2 expm1
    floor ge gt imag integer_pow is_finite le lgamma log log1p logistic lt max min mul ne
    neg nextafter not or population_count pow real reduce_precision rem round rsqrt
    select_n shift_left shift_right_arithmetic shift_right_logical sign sin sinh sqrt
    square sub tan tanh xor stop_gradient bessel_i0e bessel_i1e clz igamma igamma_grad_a
    igammac polygamma regularized_incomplete_beta zeta
    tanh_residual tanh_tangent tanh_cotangent tanh_residual_jvp tanh_residual_jvp_tangent
    tanh_residual_jvp_cotangent tanh_tangent_jvp tanh_tangent_jvp_tangent
    tanh_tangent_jvp_cotangent tanh_cotangent_jvp tanh_cotangent_jvp_tangent
    tanh_cotangent_jvp_cotangent tanh_cotangent_add tanh_cotangent_add_jvp
    tanh_cotangent_add_jvp_tangent tanh_cotangent_add_jvp_cotangent""".split()  # fcir's derivative ops (docs/ops.md)
)
LAYOUT = frozenset({"sharding_constraint", "reshard", "mesh_cast"})
PER_MEMBER = ELEMENTWISE | LAYOUT
