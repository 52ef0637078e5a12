"""A gradient of a gradient through ``lax.scan`` prints one IR on JAX 0.10.2 and 0.12 and
runs like ``jax.jit`` (ir.md guarantee 1) on both (fcir/jaxcompat/scan_outputs.py).

The inner ``jax.grad`` leaves a forward scan whose stacked outputs are its residuals; the
outer gradient linearizes that scan again and needs some of the same values as residuals
of its own. JAX 0.10.2 returns each such value from the scan twice; JAX 0.12 returns it
once (it forwards the duplicate to the stacked output). XLA prices the two forms
differently (it fuses a residual's elementwise producer into the update of each stacked
output that holds it). So capture keeps 0.10.2's form on every JAX (here three values
stacked twice; fedavg_transformer_grad: 21), and the XLA backend binds such a scan as the
running JAX does: merged on 0.12, as it is on 0.10.2 (tests/golden/README.md).
"""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from fcir.interpreters import xla

import fcir
from fcir.frontend import jaxpr_cache as captured
from fcir.jaxcompat import scan_outputs

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


def _jaxpr_duplicates(closed) -> int:
    """How many stacked outputs of the scans in ``closed`` (nested ones too) repeat an
    earlier one of the same scan (what JAX 0.12's linearization merges)."""
    return scan_outputs.stacked_copies(closed)


def test_second_order_scan_gradient_captures_jax_0_10s_residuals_on_every_jax():
    module = fcir.capture(jax.grad(_outer), *_args())
    assert sum(len(_stacked_duplicates(s)) for s in _scans(module)) == 3


# One process: JAX traces the gradient itself, and fcir captures it (capture mode) and
# traces it with only scan_outputs.keeping_copies() (what a capture's retrace with JAX's
# own derivative rules runs under), in either order; it prints how many values each
# trace's scans stack twice. That config state is part of JAX's trace context, so no
# trace may reuse another's (under jax.jit JAX caches the linearization of the jitted
# function; a fresh process: what earlier tests traced cannot mask a leak).
_SCRIPT = textwrap.dedent(
    """
    import json, sys
    sys.path.insert(0, {tests!r})
    import jax, fcir
    from fcir.jaxcompat import scan_outputs
    from test_scan_residuals import _args, _outer, _jaxpr_duplicates, _scans, _stacked_duplicates

    fn, args = jax.grad(jax.jit(_outer)), _args()

    def by_jax():
        jaxpr = jax.make_jaxpr(fn)(*args)
        jax.jit(fn).lower(*args).compile()(*args)
        return _jaxpr_duplicates(jaxpr)

    def by_fcir():
        module = fcir.capture(fn, *args)
        with scan_outputs.keeping_copies():
            kept = _jaxpr_duplicates(jax.make_jaxpr(fn)(*args))
        return sum(len(_stacked_duplicates(s)) for s in _scans(module)), kept

    if sys.argv[1] == "jax_first":
        jax_dups = by_jax()
        capture, kept = by_fcir()
    else:
        capture, kept = by_fcir()
        jax_dups = by_jax()
    print(json.dumps({{"capture": capture, "kept": kept, "jax": jax_dups}}))
    """
).format(tests=str(pathlib.Path(__file__).resolve().parent))


@pytest.mark.slow  # a fresh process each: left out of the fast tier
@pytest.mark.parametrize("order", ["jax_first", "capture_first"])
def test_capture_keeps_copies_and_jax_keeps_its_own_form_whatever_traced_before(order):
    proc = subprocess.run(
        [sys.executable, "-c", _SCRIPT, order],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=pathlib.Path(__file__).resolve().parents[2],
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result == {"capture": 3, "kept": 3, "jax": 3 if JAX_0_10 else 0}


def _jit(fn, args):
    ref = jax.jit(fn).lower(*args).compile()
    return np.asarray(ref(*args)).tobytes(), _flops(ref)


def test_second_order_scan_gradient_runs_like_jit():
    args = _args()
    fn = jax.grad(_outer)
    assert _run(fcir.capture(fn, *args), args) == _jit(fn, args)


def test_second_order_scan_gradient_runs_like_jit_from_captures_own_jaxpr():
    # Without forget: xla.compile may take capture's jaxpr instead of tracing the IR;
    # on 0.12 that jaxpr has the copies, so it must trace the IR (and merge) instead.
    args = _args()
    fn = jax.grad(_outer)
    exe = xla.compile(fcir.capture(fn, *args))
    assert (np.asarray(exe(*args)).tobytes(), _flops(exe.compiled(*args))) == _jit(fn, args)


def test_xla_binds_a_scan_stacking_one_value_twice_as_the_running_jax():
    module = fcir.capture(jax.grad(_outer), *_args())
    captured.forget(module)
    jaxpr = jax.make_jaxpr(lambda *a: xla.XlaInterpreter().run(module, *a))(*_args())
    assert _jaxpr_duplicates(jaxpr) == (3 if JAX_0_10 else 0)


def test_merging_the_copies_in_the_ir_gives_the_flops_of_jit_only_on_jax_0_12():
    # The merged IR is another program for XLA on 0.10.2 (fewer flops than jax.jit of
    # the gradient); on 0.12 the backend merges the copies itself, so both texts run
    # with jax.jit's flops. Why the shared text is 0.10.2's.
    args = _args()
    module = fcir.capture(jax.grad(_outer), *args)
    bits, flops = _run(module, args)
    assert _merge_duplicates(module) == 3
    fcir.check(module)
    merged_bits, merged_flops = _run(module, args)
    assert merged_bits == bits
    if JAX_0_10:
        assert merged_flops < flops
    else:
        assert merged_flops == flops


def _stacks_twice(c0, xs):
    def body(c, x):
        y = jnp.sin(x * c) + 1.0
        return c + 1.0, (y, y)

    return jax.lax.scan(body, c0, xs)


def test_a_user_scan_stacking_one_value_twice_runs_merged_on_jax_0_12():
    # The known cost of one text: the IR cannot tell a user's scan returning one value
    # twice from a linearized one, and JAX 0.12's jax.jit keeps the user's copies. The
    # backend merges both: same bits, fewer flops than jax.jit of such a program.
    args = (np.float32(1.0), np.ones((5, 64), np.float32))
    module = fcir.capture(_stacks_twice, *args)
    captured.forget(module)
    exe = xla.compile(module)
    ref = jax.jit(_stacks_twice).lower(*args).compile()
    got, want = exe(*args), ref(*args)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        assert np.asarray(a).tobytes() == np.asarray(b).tobytes()
    if JAX_0_10:
        assert _flops(exe.compiled(*args)) == _flops(ref)
    else:
        assert _flops(exe.compiled(*args)) < _flops(ref)
