"""What a program does, shown to its user.

- ``traffic``: the bytes one round communicates, read from the IR alone;
- ``progress``: a per-round progress line for training loops;
- ``dot``: the dataflow graph as Graphviz ``dot`` or SVG (``fcir show --format``).
"""
