"""A compact decoder-only transformer language model, and synthetic token streams.

Small enough to train on a laptop CPU in seconds: token and position embeddings,
``LAYERS`` pre-norm blocks of causal self-attention and a GELU MLP, tied unembedding.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

VOCAB, SEQ, WIDTH, LAYERS, HEADS = 32, 16, 32, 2, 2


def init_params(seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)

    def normal(*shape, scale):
        return jnp.asarray(rng.normal(0.0, scale, shape), jnp.float32)

    d = WIDTH
    layer = lambda: {
        "norm1": jnp.ones(d), "qkv": normal(d, 3 * d, scale=d**-0.5),
        "proj": normal(d, d, scale=d**-0.5), "norm2": jnp.ones(d),
        "up": normal(d, 4 * d, scale=d**-0.5), "down": normal(4 * d, d, scale=(4 * d) ** -0.5),
    }  # fmt: skip
    return {
        "embed": normal(VOCAB, d, scale=0.1),
        "pos": normal(SEQ, d, scale=0.1),
        "layers": [layer() for _ in range(LAYERS)],
        "norm": jnp.ones(d),
    }


def _norm(x, scale):
    x = x - x.mean(-1, keepdims=True)
    return x * jax.lax.rsqrt((x * x).mean(-1, keepdims=True) + 1e-5) * scale


def _attention(x, p):
    seq, d = x.shape[-2:]
    q, k, v = jnp.split(x @ p["qkv"], 3, axis=-1)
    q, k, v = (t.reshape(*t.shape[:-1], HEADS, d // HEADS) for t in (q, k, v))
    scores = jnp.einsum("...qhd,...khd->...hqk", q, k) * (d // HEADS) ** -0.5
    scores = jnp.where(jnp.tril(jnp.ones((seq, seq), bool)), scores, -1e9)
    out = jnp.einsum("...hqk,...khd->...qhd", jax.nn.softmax(scores), v)
    return out.reshape(x.shape) @ p["proj"]


def logits(params, tokens):
    """int32[..., seq] -> f32[..., seq, VOCAB]"""
    x = params["embed"][tokens] + params["pos"][: tokens.shape[-1]]
    for p in params["layers"]:
        x = x + _attention(_norm(x, p["norm1"]), p)
        x = x + jax.nn.gelu(_norm(x, p["norm2"]) @ p["up"]) @ p["down"]
    return _norm(x, params["norm"]) @ params["embed"].T


def loss(params, tokens):
    """Mean next-token cross-entropy of int32 ``tokens[batch, SEQ + 1]``."""
    logp = jax.nn.log_softmax(logits(params, tokens[..., :-1]))
    return -jnp.take_along_axis(logp, tokens[..., 1:, None], axis=-1).mean()


def token_streams(rng: np.random.Generator, clients: int, *shape: int) -> np.ndarray:
    """int32[clients, *shape, SEQ + 1]: each sequence counts up from a random start by
    its client's stride (mod VOCAB), so every client speaks a slightly different
    language and the model can learn all of them."""
    start = rng.integers(0, VOCAB, (clients, *shape, 1))
    stride = (np.arange(clients) % 3 + 1).reshape(clients, *(1,) * len(shape), 1)
    return ((start + stride * np.arange(SEQ + 1)) % VOCAB).astype(np.int32)
