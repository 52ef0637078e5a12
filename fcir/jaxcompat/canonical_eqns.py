"""Canonical forms capture gives equations whose shape depends on the JAX that traced
them, so that the IR is the same under every supported JAX.

- A ``scan`` whose leading (constant) operands include scalar literals: JAX 0.12's
  partial evaluation passes literals of the loop body (``0.9`` in ``0.9 ** step``) as
  constant operands, where JAX 0.10.2 keeps them literals inside the body. The canonical
  scan has no literal constant operands: each is a literal at its uses in the body
  (:func:`scan_literal_consts_inlined`), and so a constant made at each use in the IR.

The derivative rules capture pins for the same purpose are in
:mod:`fcir.jaxcompat.ad_rules`.
"""

from __future__ import annotations

import numpy as np

from fcir import jaxcompat as jc
from fcir.jaxcompat import core, schema


def _scalar_literal(atom) -> bool:
    return isinstance(atom, core.Literal) and np.ndim(atom.val) == 0


def scan_literal_consts_inlined(eqn):
    """``eqn`` itself, or for a ``scan`` with scalar literal constant operands the same
    scan with those literals moved into its body."""
    if eqn.primitive.name != "scan":
        return eqn
    nc, _ = schema.scan_counts(eqn.params)
    sunk = {i: a for i, a in enumerate(eqn.invars[:nc]) if _scalar_literal(a)}
    if not sunk:
        return eqn
    closed = eqn.params["jaxpr"]
    body = jc.open_jaxpr(closed)
    literal = {body.invars[i]: a for i, a in sunk.items()}

    def subst(atoms):
        return [literal.get(a, a) if isinstance(a, core.Var) else a for a in atoms]

    new_body = body.replace(
        invars=[v for i, v in enumerate(body.invars) if i not in sunk],
        eqns=[e.replace(invars=subst(e.invars)) for e in body.eqns],
        outvars=subst(body.outvars),
    )
    params = schema.to_fcir("scan", dict(eqn.params))
    params["num_consts"] = nc - len(sunk)
    params["jaxpr"] = jc.closed_jaxpr(new_body, jc.consts_of(closed))
    if "linear" in params:
        params["linear"] = tuple(x for i, x in enumerate(params["linear"]) if i not in sunk)
    return eqn.replace(
        invars=[a for i, a in enumerate(eqn.invars) if i not in sunk],
        params=schema.to_jax("scan", params),
    )
