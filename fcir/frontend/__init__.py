"""The frontend: from a JAX function to a Module.

- ``program``: ``fcir.program`` and the placement context each fed op's public function
  (in its ``fcir.fed`` module) reads;
- ``primitives``: what the fed ops' JAX primitives share (their factories and helpers);
- ``autodiff``: what their derivative rules share;
- ``capture``: tracing a function and converting its jaxpr into a Module;
- ``jaxpr_cache``: the jaxpr a Module was converted from, kept while it is unchanged;
- ``pytrees``: results with the program's own pytree classes;
- ``sharding``: DrJAX's mesh layout rules for placed values;
- ``loading``: loading a program for a command line (an IR file or ``file.py:fn``).
"""
