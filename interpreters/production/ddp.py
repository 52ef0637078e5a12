"""The distributed DP aggregates for production: ``fed.ddp_sum`` / ``fed.ddp_mean``
decomposed into what a DistributeAggregateForm round runs where (``fcir.ddp``):

* a ``fed.map`` in which every client clips, rotates, quantizes and noises its pytree
  with its own key into ``uint32`` residues modulo ``2**bits`` (``fcir.ddp.encode``):
  client_work;
* one ``fed.secure_sum`` with ``bitwidth=bits``: client_to_server_aggregation, as
  ``federated_secure_sum_bitwidth``, so the aggregation service only ever adds noised
  residues and the server only sees their modular sum;
* the decoding (``fcir.ddp.decode``): server_result.

The decomposition is traced with the very functions the primitive's rules use, so it
computes bit for bit what the op computes.
"""

from __future__ import annotations

__all__ = ["decomposed_program"]


def decomposed_program(op, placement: str, n: int, member_shapes):
    """An ``@fcir.program`` of ``(keys, *xs)`` that computes ``op`` in plain fed ops."""
    import jax

    import fcir
    from fcir import ddp

    like = [jax.ShapeDtypeStruct(s, d) for s, d in member_shapes]
    p = ddp.params(
        ddp.member_dim(s for s, _ in member_shapes),
        n,
        op.attrs["clip_norm"],
        op.attrs["noise_multiplier"],
        op.attrs["bits"],
        op.name,
    )
    mean = op.name == "fed.ddp_mean"

    @fcir.program(placements={placement: n})
    def decomposed(keys, *xs):
        shares = fcir.map_fn(lambda k, *m: ddp.encode(m, k, p), (keys, *xs))
        total = fcir.secure_sum(shares, bitwidth=p.bits)
        return ddp.decode(total, p, like, mean)

    return decomposed
