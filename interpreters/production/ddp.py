"""The distributed DP aggregates for production: ``fed.ddp_sum`` / ``fed.ddp_mean``
decomposed into what a DistributeAggregateForm round runs where (``fcir.mechanisms.ddgauss``):

* a ``fed.map`` in which every client clips, rotates, quantizes and noises its pytree
  with its own key into ``uint32`` residues modulo ``2**bits`` (``fcir.mechanisms.ddgauss.encode``):
  client_work;
* one ``fed.secure_sum`` with ``bitwidth=bits``: client_to_server_aggregation, as
  ``federated_secure_sum_bitwidth``, so the aggregation service only ever adds noised
  residues and the server only sees their modular sum;
* the decoding (``fcir.mechanisms.ddgauss.decode``): server_result.

The decomposition is traced with the very functions the primitive's rules use, so it
computes bit for bit what the op computes.
"""

from __future__ import annotations

import fcir
from fcir import fed as F
from fcir.mechanisms import ddgauss as ddp

__all__ = ["MECHANISM", "decomposed_program", "mechanism"]

MECHANISM = (
    "distributed discrete Gaussian (fcir.mechanisms.ddgauss): each client clips, rotates, quantizes its "
    "update and adds its share of discrete Gaussian noise in client_work, the shares are "
    "summed modulo 2**bits by federated_secure_sum_bitwidth, the server decodes the "
    "noised sum in server_result; client-level DP (one client's update replaced by zero); "
    "epsilon assumes the noise shares of at least each release's min_clients clients are "
    "in the sum (its cardinality unless declared lower; releases[].min_clients): an "
    "aggregation runtime that sums fewer clients' shares must refuse the round"
)


def _distributed(release: dict) -> bool:
    return F.ops()[release["op"]].kind == "ddp"


def mechanism(entry: dict | None) -> str | None:
    """The mechanism text of a manifest/plan privacy entry with ``fed.ddp_*`` releases
    (None without them)."""
    if not entry or not any(_distributed(r) for r in entry["releases"]):
        return None
    if all(_distributed(r) for r in entry["releases"]):
        return MECHANISM
    return MECHANISM + "; the fed.dp_* releases: Gaussian noise added at the server"


def decomposed_program(op, placement: str, n: int, member_shapes, *, mean: bool):
    """An ``@fcir.program`` of ``(keys, *xs)`` that computes ``op`` in plain fed ops
    (``mean``: ``fed.ddp_mean``, the decoded sum divided by the cardinality)."""
    import jax

    like = [jax.ShapeDtypeStruct(s, d) for s, d in member_shapes]
    p = ddp.attr_params(op.attrs, ddp.member_dim(s for s, _ in member_shapes), n, op.name)

    @fcir.program(placements={placement: n})
    def decomposed(keys, *xs):
        shares = fcir.map_fn(lambda k, *m: ddp.encode(m, k, p), (keys, *xs))
        total = fcir.secure_sum(shares, bitwidth=p.bits)
        return ddp.decode(total, p, like, mean)

    return decomposed
