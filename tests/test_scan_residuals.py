"""A gradient of a gradient through ``lax.scan`` keeps the running JAX's scan residuals,
so it runs like ``jax.jit`` (ir.md guarantee 1) on JAX 0.10.2 and 0.12 alike.

The inner ``jax.grad`` leaves a forward scan whose stacked outputs are its residuals; the
outer gradient linearizes that scan again and needs some of the same values as residuals
of its own. JAX 0.12 returns each such value from the scan once (it forwards the
duplicate to the stacked output); JAX 0.10.2 returns it twice. XLA prices the two forms
differently (it fuses a residual's elementwise producer into the update of each stacked
output that holds it), and one IR text lowers to one of them, so capture keeps the
running JAX's form: here three residuals twice on 0.10.2, none on 0.12
(fedavg_transformer_grad: 21 and 20; tests/golden/README.md).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from fcir.interpreters import xla

import fcir
from fcir import captured

JAX_0_10 = jax.__version_info__ < (0, 11)


def _inner_loss(w, x):
    def layer(h, wi):
        c = h - jnp.mean(h, axis=-1, keepdims=True)
        n = c * jax.lax.rsqrt(jnp.mean(c * c, axis=-1, keepdims=True) + 1e-5)
        return jnp.sin(n @ wi), None

    h, _ = jax.lax.scan(layer, x, w)
    return jnp.sum(h * h)


def _outer(w, x):
    return _inner_loss(w - 0.1 * jax.grad(_inner_loss)(w, x), x)


def _args():
    rng = np.random.default_rng(0)
    w = rng.normal(size=(3, 4, 4)).astype(np.float32)  # 3 layers of 4x4
    x = rng.normal(size=(2, 4)).astype(np.float32)
    return w, x


def _flops(compiled) -> float:
    a = compiled.cost_analysis()
    return (a[0] if isinstance(a, (list, tuple)) else a)["flops"]


def _run(module, args):
    """(output bytes, XLA flops) of ``module`` rebuilt from its IR."""
    captured.forget(module)
    exe = xla.compile(module)
    return np.asarray(exe(*args)).tobytes(), _flops(exe.compiled(*args))


def _stacked_duplicates(scan) -> list[tuple[int, int]]:
    """(kept, duplicate) result indices of ``scan``'s stacked outputs yielding one value."""
    num_carry = scan.attrs["num_carry"]
    first, dups = {}, []
    for i, v in enumerate(scan.regions[0].results[num_carry:], num_carry):
        if v in first:
            dups.append((first[v], i))
        else:
            first[v] = i
    return dups


def _scans(module):
    return [op for _, op in fcir.ir.walk(module.main.body) if op.name == "jax.scan"]


def _merge_duplicates(module) -> int:
    """Rewrites ``module`` to JAX 0.12's form: each scan returns a value it stacks twice
    once, and the duplicate's uses read the kept result. Returns how many it merged."""
    subs = {}
    for scan in _scans(module):
        dups = _stacked_duplicates(scan)
        gone = {d for _, d in dups}
        subs.update({scan.results[d]: scan.results[k] for k, d in dups})
        body = scan.regions[0]
        body.results = [v for i, v in enumerate(body.results) if i not in gone]
        scan.results = [v for i, v in enumerate(scan.results) if i not in gone]

    def rewrite(region):
        region.results = [subs.get(v, v) for v in region.results]
        for op in region.ops:
            op.operands = [subs.get(v, v) for v in op.operands]
            for sub in op.regions:
                rewrite(sub)

    rewrite(module.main.body)
    return len(subs)


def test_second_order_scan_gradient_keeps_the_running_jaxs_residuals():
    module = fcir.capture(jax.grad(_outer), *_args())
    dups = sum(len(_stacked_duplicates(s)) for s in _scans(module))
    assert dups == (3 if JAX_0_10 else 0)


def test_second_order_scan_gradient_runs_like_jit():
    args = _args()
    fn = jax.grad(_outer)
    ref = jax.jit(fn).lower(*args).compile()
    assert _run(fcir.capture(fn, *args), args) == (np.asarray(ref(*args)).tobytes(), _flops(ref))


@pytest.mark.skipif(not JAX_0_10, reason="JAX 0.12 returns each residual once already")
def test_merging_jax_0_10s_duplicate_residuals_keeps_the_bits_but_not_jits_flops():
    # Why capture does not print 0.12's form on 0.10.2: the merged IR is another program
    # for XLA (fewer flops), so xla.compile of it would not be jax.jit of the gradient.
    args = _args()
    module = fcir.capture(jax.grad(_outer), *args)
    bits, flops = _run(module, args)
    assert _merge_duplicates(module) == 3
    fcir.check(module)
    merged_bits, merged_flops = _run(module, args)
    assert merged_bits == bits
    assert merged_flops < flops
