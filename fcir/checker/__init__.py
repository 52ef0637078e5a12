"""The checker (``fcir.check`` / ``fcir.verify``): a Module's ops against their rules.

- ``check``: SSA scoping, the fed ops' type rules, placement discipline, and the
  privacy leak check of a private module;
- ``local_ops``: a local (``jax.*``) op's result types re-derived by JAX's abstract
  evaluation;
- ``opnames``: the names an op may carry, and the one did-you-mean for a name no op has.

It reads the fed ops and ``fcir.privacy``, so it sits above them (the IR below knows
no op).
"""
