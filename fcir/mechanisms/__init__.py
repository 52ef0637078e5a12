"""The numerics of the DP noise mechanisms: what the DP ops compute on the values.

- ``gaussian``: the standard normal draws of the central DP ops (``fed.dp_sum``,
  ``fed.dp_mean``);
- ``ddgauss``: the distributed discrete Gaussian mechanism of ``fed.ddp_sum`` /
  ``fed.ddp_mean`` (encoding, noise, modular sum, decoding) and its bounds.

They sit below the fed ops that call them and below ``fcir.privacy``, whose accountant
reads their bounds.
"""
