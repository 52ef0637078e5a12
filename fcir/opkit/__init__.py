"""What the fed ops are built with (each op's module in ``fcir.fed`` imports these).

- ``placement``: ``fcir.program`` and the placement context each fed op's public
  function reads and binds its primitive with;
- ``primitives``: what the fed ops' JAX primitives share (their factories, placed and
  member types, dtype conventions);
- ``autodiff``: what their derivative rules share (symbolic zeros, linear JVPs);
- ``sharding``: DrJAX's mesh layout rules for placed values.

It names no op: it sits below ``fcir.fed``, above the IR.
"""
