"""The frontend: from a JAX function to a Module, and what reads a captured program.

- ``capture``: tracing a function and converting its jaxpr into a Module;
- ``jaxpr_cache``: the jaxpr a Module was converted from, kept while it is unchanged;
- ``pytrees``: results with the program's own pytree classes;
- ``evaluation``: ``fcir.evaluation``, a program's declared evaluation as a program;
- ``loading``: loading a program for a command line (an IR file or ``file.py:fn``).

What the ops are built with (``fcir.program``'s placement context, the primitives'
factories, derivative and sharding helpers) is ``fcir.opkit``, below the ops.
"""
