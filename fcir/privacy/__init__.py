"""Differential privacy as a property of the program.

``fcir.privacy.leaks`` (the check that client data reaches the server only through the
DP aggregates), ``epsilon`` / ``round_cost`` (the accountant) and ``Budget`` (a budget
spent round by round) are the public names; the modules hold:

- ``analysis``: the leak check and the accountant (``privacy/C*`` constraints);
- ``budget``: ``Budget``;
- ``keys``: where each DP release's PRNG key comes from (``privacy/C4``, ``C5``);
- ``sampler_error``: how far the integer discrete Gaussian sampler is from the exact law.

The noise mechanisms themselves (what the DP ops compute) are in ``fcir.mechanisms``.
"""

from fcir.privacy.analysis import (
    CONSTRAINTS,
    DP_OPS,
    RULES,
    DdpRelease,
    ExactRelease,
    Leak,
    Release,
    epsilon,
    format_round_cost,
    leaks,
    releases,
    round_cost,
    rounds_arg,
    sampler_tv,
)
from fcir.privacy.budget import Budget
