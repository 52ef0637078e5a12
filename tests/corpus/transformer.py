"""A small decoder-only transformer language model and a FedAvg round over it.

The pieces are public so ``bench/`` can build the same round at larger sizes:

- ``init_params(key, vocab, d, layers, ...)``: parameter pytree; per-layer weights
  are stacked on a leading ``layers`` axis and applied with ``lax.scan``
  (``logits_fn`` also takes them as a list of per-layer dicts, a Python loop).
- ``loss_fn(params, tokens, num_heads)``: next-token softmax cross-entropy.
- ``local_train(params, batches, lr, num_heads)``: SGD, one step per batch.
- ``make_round(num_clients, ...)``: the federated round, for ``fcir`` or ``drjax``;
  ``fedavg_program(num_clients, update)`` the same round around another client update.
- ``make_args(num_clients, ...)``: deterministic parameters and client tokens.

The model exercises an embedding gather, causal multi-head self-attention, layer
norm, GELU, softmax and log-softmax, integer-label gather, and scan over layers.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

import fcir

from . import loops
from .case import Case, sum_of_squares
from .oracle_jit import oracle_jit

# Corpus sizes; bench passes its own.
NUM_CLIENTS = 4
VOCAB, SEQ, D_MODEL, LAYERS, HEADS = 32, 8, 16, 2, 2
LOCAL_STEPS, BATCH = 2, 2
LR = 0.1
DRJAX_EXPRESSIBLE = True


def init_params(
    key: jax.Array, vocab: int, d: int, layers: int, *, seq: int = SEQ, mlp_ratio: int = 2
) -> dict:
    """Parameters of a ``layers``-deep model of width ``d`` over contexts up to ``seq``."""
    hidden = mlp_ratio * d
    random_shapes = {  # name: (shape, standard deviation)
        "embed": ((vocab, d), 0.5),
        "pos": ((seq, d), 0.1),
        "wqkv": ((layers, d, 3 * d), d**-0.5),
        "wo": ((layers, d, d), d**-0.5),
        "w_in": ((layers, d, hidden), d**-0.5),
        "w_out": ((layers, hidden, d), hidden**-0.5),
        "unembed": ((d, vocab), d**-0.5),
    }
    # One draw carved into pieces: one random-number kernel to compile, not seven.
    sizes = [int(np.prod(shape)) for shape, _ in random_shapes.values()]
    flat = np.asarray(jax.random.normal(key, (sum(sizes),), jnp.float32))
    w = {
        name: jnp.asarray(piece.reshape(shape) * np.float32(std))
        for (name, (shape, std)), piece in zip(
            random_shapes.items(), np.split(flat, np.cumsum(sizes)[:-1])
        )
    }

    def ones(*shape):
        return jnp.asarray(np.ones(shape, np.float32))

    def zeros(*shape):
        return jnp.asarray(np.zeros(shape, np.float32))

    return {
        "embed": w["embed"],
        "pos": w["pos"],
        "layers": {
            "ln1_scale": ones(layers, d),
            "ln1_bias": zeros(layers, d),
            "wqkv": w["wqkv"],
            "wo": w["wo"],
            "ln2_scale": ones(layers, d),
            "ln2_bias": zeros(layers, d),
            "w_in": w["w_in"],
            "b_in": zeros(layers, hidden),
            "w_out": w["w_out"],
            "b_out": zeros(layers, d),
        },
        "ln_f_scale": ones(d),
        "ln_f_bias": zeros(d),
        "unembed": w["unembed"],
    }


def layer_norm(x, scale, bias, eps: float = 1e-5):
    mean = jnp.mean(x, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(x - mean), axis=-1, keepdims=True)
    return (x - mean) * jax.lax.rsqrt(var + eps) * scale + bias


def causal_attention(x, wqkv, wo, num_heads: int):
    batch, seq, d = x.shape
    head_dim = d // num_heads
    q, k, v = jnp.split(x @ wqkv, 3, axis=-1)
    q, k, v = (t.reshape(batch, seq, num_heads, head_dim) for t in (q, k, v))
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(head_dim).astype(np.float32)
    causal = jnp.tril(jnp.ones((seq, seq), jnp.bool_))
    # A finite fill keeps fully-masked rows (none here) and their gradients NaN-free.
    scores = jnp.where(causal, scores, jnp.float32(-1e9))
    probs = jax.nn.softmax(scores, axis=-1)
    out = jnp.einsum("bhqk,bkhd->bqhd", probs, v).reshape(batch, seq, d)
    return out @ wo


def block(x, p, num_heads: int):
    x = x + causal_attention(
        layer_norm(x, p["ln1_scale"], p["ln1_bias"]), p["wqkv"], p["wo"], num_heads
    )
    h = jax.nn.gelu(layer_norm(x, p["ln2_scale"], p["ln2_bias"]) @ p["w_in"] + p["b_in"])
    return x + h @ p["w_out"] + p["b_out"]


def logits_fn(params, tokens, num_heads: int):
    """``tokens``: int32[batch, seq] -> logits f32[batch, seq, vocab].

    ``params["layers"]`` is either the dict of per-layer weights stacked on a leading
    layers axis (``init_params``), applied by one ``lax.scan``, or a list (any
    iterable) of one dict per layer, applied by a Python loop: one copy of the block
    per layer in the jaxpr, as flax and hand-written models trace (``bench/scale.py``
    measures both)."""
    x = params["embed"][tokens] + params["pos"][: tokens.shape[-1]]
    if isinstance(params["layers"], dict):

        def layer(h, p):
            return block(h, p, num_heads), None

        x, _ = jax.lax.scan(layer, x, params["layers"])
    else:
        for p in params["layers"]:
            x = block(x, p, num_heads)
    x = layer_norm(x, params["ln_f_scale"], params["ln_f_bias"])
    return x @ params["unembed"]


def loss_fn(params, tokens, num_heads: int = HEADS):
    """Mean next-token cross-entropy of int32 ``tokens[batch, seq + 1]``."""
    logits = logits_fn(params, tokens[:, :-1], num_heads)
    logp = jax.nn.log_softmax(logits, axis=-1)
    nll = -jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1)
    return jnp.mean(nll)


def local_train(params, batches, lr: float, num_heads: int = HEADS):
    """SGD over ``batches`` int32[steps, batch, seq + 1]; returns (params, mean loss)."""

    def step(p, tokens):
        value, grads = jax.value_and_grad(loss_fn)(p, tokens, num_heads)
        return jax.tree.map(lambda w, g: w - lr * g, p, grads), value

    params, losses = jax.lax.scan(step, params, batches)
    return params, jnp.mean(losses)


def client_update(params, batches, lr: float, num_heads: int):
    trained, loss = local_train(params, batches, lr, num_heads)
    return jax.tree.map(lambda new, old: new - old, trained, params), loss


def make_round(num_clients: int, *, lr: float = LR, num_heads: int = HEADS, api=fcir):
    """FedAvg round ``(params, tokens{[steps, batch, seq+1]}@clients) -> (params, loss)``."""
    update = functools.partial(client_update, lr=lr, num_heads=num_heads)
    return fedavg_program(num_clients, update, api=api)


def fedavg_program(num_clients: int, update, *, api=fcir, name: str = "fedavg_transformer"):
    """The FedAvg round around a member's ``update(params, batches) -> (delta, loss)``:
    broadcast the parameters, map, apply the mean delta, mean the losses. ``name``
    names the program (fcir's module)."""

    def fedavg(params, tokens):
        deltas, losses = api.map_fn(update, (api.broadcast(params), tokens))
        mean_delta = api.reduce_mean(deltas)
        new_params = jax.tree.map(lambda p, d: p + d, params, mean_delta)
        return new_params, api.reduce_mean(losses)

    fedavg.__name__ = fedavg.__qualname__ = name
    return api.program(placements={"clients": num_clients})(fedavg)


def make_tokens(
    rng: np.random.Generator, shape: tuple[int, ...], seq: int, vocab: int
) -> jax.Array:
    """Learnable token streams: each sequence counts up from a random start by a random
    stride, mod ``vocab``. Shape ``shape + (seq + 1,)``, int32."""
    start = rng.integers(0, vocab, (*shape, 1))
    stride = rng.integers(1, 4, (*shape, 1))
    return jnp.asarray((start + stride * np.arange(seq + 1)) % vocab, jnp.int32)


def make_args(
    num_clients: int = NUM_CLIENTS,
    *,
    vocab: int = VOCAB,
    seq: int = SEQ,
    d: int = D_MODEL,
    layers: int = LAYERS,
    local_steps: int = LOCAL_STEPS,
    batch: int = BATCH,
    seed: int = 0,
):
    params = init_params(jax.random.key(seed), vocab, d, layers, seq=seq)
    tokens = make_tokens(np.random.default_rng(seed), (num_clients, local_steps, batch), seq, vocab)
    return params, tokens


def build(api=fcir):
    return make_round(NUM_CLIENTS, api=api)


# The member's computation is the program's own ``client_update``, compiled once: this
# oracle checks the federated structure (broadcast, per-member map, mean) of a model
# too large to restate, and op-by-op execution would take tens of seconds.
@oracle_jit
def _oracle_client(params, tokens, i):
    return client_update(params, tokens[i], LR, HEADS)


@oracle_jit
def _oracle_server(params, deltas, losses):
    mean_delta = loops.mean(deltas)
    return jax.tree.map(jnp.add, params, mean_delta), loops.mean(losses)


def oracle(params, tokens):
    deltas, losses = zip(*[_oracle_client(params, tokens, i) for i in range(NUM_CLIENTS)])
    return _oracle_server(params, list(deltas), list(losses))


CASE = Case(
    name="fedavg_transformer",
    fn=build(),
    make_args=make_args,
    oracle=oracle,
    grad_argnums=(0,),
    loss=sum_of_squares,
)
