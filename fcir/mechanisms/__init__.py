"""The numerics of the DP noise mechanisms: what the DP ops compute on the values.

- ``clipping``: a member's pytree clipped to an L2 norm, the clip of every DP op;
- ``gaussian``: the standard normal draws of the central DP ops (``fed.dp_sum``,
  ``fed.dp_mean``) and the noise they add to a leaf (``dp_noise``);
- ``ddgauss``: the distributed discrete Gaussian mechanism of ``fed.ddp_sum`` /
  ``fed.ddp_mean`` (encoding, noise, modular sum, decoding) and its bounds.

They sit below the fed ops that call them and below ``fcir.privacy``, whose accountant
reads their bounds.
"""
