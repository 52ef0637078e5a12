"""The small CNN of pfl-research's CIFAR-10 benchmark, in plain JAX: two 3x3 valid
convolutions (32, 64 channels) with ReLU, a 2x2 max pool, a 128-unit ReLU layer and 10
logits (its dropout left out: every system here trains without it). Inputs NHWC.

One module for every JAX system of bench/simulate.py (fcir, DrJAX, this Flower app),
so they train the same model; it imports only jax and numpy, since a Flower app ships
it to its ClientApps."""

import jax
import jax.numpy as jnp
import numpy as np

CLASSES = 10
LR = 0.1  # pfl's benchmark: local_learning_rate 0.1, plain SGD


def init_params(seed: int = 0, shape=(32, 32, 3), classes: int = CLASSES) -> dict:
    """Glorot-uniform weights (as pfl's model), zero biases; float32 numpy arrays."""
    rng = np.random.default_rng(seed)
    h, w, c = shape
    flat = ((h - 4) // 2) * ((w - 4) // 2) * 64

    def glorot(*s, fan_in, fan_out):
        lim = np.sqrt(6.0 / (fan_in + fan_out))
        return rng.uniform(-lim, lim, s).astype(np.float32)

    return {
        "conv1_w": glorot(3, 3, c, 32, fan_in=9 * c, fan_out=9 * 32),
        "conv1_b": np.zeros(32, np.float32),
        "conv2_w": glorot(3, 3, 32, 64, fan_in=9 * 32, fan_out=9 * 64),
        "conv2_b": np.zeros(64, np.float32),
        "dense1_w": glorot(flat, 128, fan_in=flat, fan_out=128),
        "dense1_b": np.zeros(128, np.float32),
        "dense2_w": glorot(128, classes, fan_in=128, fan_out=classes),
        "dense2_b": np.zeros(classes, np.float32),
    }


def _conv(x, w, b):
    dn = ("NHWC", "HWIO", "NHWC")
    y = jax.lax.conv_general_dilated(x, w, (1, 1), "VALID", dimension_numbers=dn)
    return jax.nn.relu(y + b)


def logits(p, x):
    """``x``: float32[batch, H, W, C] -> float32[batch, classes]."""
    h = _conv(_conv(x, p["conv1_w"], p["conv1_b"]), p["conv2_w"], p["conv2_b"])
    h = jax.lax.reduce_window(h, -jnp.inf, jax.lax.max, (1, 2, 2, 1), (1, 2, 2, 1), "VALID")
    h = jax.nn.relu(h.reshape(h.shape[0], -1) @ p["dense1_w"] + p["dense1_b"])
    return h @ p["dense2_w"] + p["dense2_b"]


def loss(p, x, y):
    """Mean softmax cross-entropy of integer labels ``y``."""
    logp = jax.nn.log_softmax(logits(p, x))
    return -jnp.mean(jnp.take_along_axis(logp, y[:, None], axis=1))


def client_update(params, x, y, lr: float = LR):
    """One local epoch of SGD over ``x``: float32[steps, batch, H, W, C] with labels
    int32[steps, batch]; returns (trained - params, mean loss)."""

    def step(p, batch):
        value, grads = jax.value_and_grad(loss)(p, *batch)
        return jax.tree.map(lambda w, g: w - lr * g, p, grads), value

    # unroll: XLA:CPU runs convolutions inside a while loop ~15x slower than outside
    # one (measured, jax 0.12); the local steps are few.
    trained, losses = jax.lax.scan(step, params, (x, y), unroll=True)
    return jax.tree.map(jnp.subtract, trained, params), jnp.mean(losses)
