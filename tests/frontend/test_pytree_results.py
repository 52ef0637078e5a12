"""Every backend returns the program's own pytree classes (registered dataclasses,
optax states, namedtuples, int-keyed dicts); a deserialized module that cannot tell
two treedefs apart falls back to the structure."""

from __future__ import annotations

import collections
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
from fcir.interpreters import production, reference, xla

import fcir
from fcir.frontend import pytrees
from fcir.ir import Module

N = 3


# --- every backend returns the program's own pytree classes ---------------------


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class _Model:  # a hand-registered pytree class, as equinox and flax modules are
    w: jax.Array
    b: jax.Array


_Pair = collections.namedtuple("_Pair", "a b")
_ADAM = optax.adam(0.1)


@fcir.program(placements={"clients": N})
def adam_round(model, opt_state, x):
    def local_grad(m, x):
        return jax.tree.map(lambda p: p * jnp.sum(x), m)

    g = fcir.reduce_mean(fcir.map_fn(local_grad, (fcir.broadcast(model), x)))
    updates, opt_state = _ADAM.update(g, opt_state)
    new = optax.apply_updates(model, updates)
    return new, opt_state, {1: new.w, 0: _Pair(new.b, g.b)}  # int keys, a namedtuple


def test_backends_return_the_programs_pytree_classes(tmp_path):
    model = _Model(jnp.ones(2), jnp.zeros(()))
    args = (model, _ADAM.init(model), jnp.arange(6.0).reshape(N, 2))
    m = fcir.capture(adam_round, *args)
    want = jax.jit(adam_round)(*args)
    production.export(m).write(tmp_path / "b")
    reread = Module.deserialize(m.serialize())  # in this process: still the own classes
    runs = {
        "reference": reference.run(m, *args),
        "xla": xla.compile(m)(*args),
        "reference(parsed)": reference.run(fcir.parse(m.to_text()), *args),
        "xla(deserialized)": xla.compile(reread)(*args),
        "production": production.run_bundle(tmp_path / "b", *args),
    }
    for name, got in runs.items():
        assert jax.tree.structure(got) == jax.tree.structure(want), name
        assert isinstance(got[0], _Model) and isinstance(got[1][0], optax.ScaleByAdamState)
        assert list(got[2]) == [0, 1] and isinstance(got[2][0], _Pair), name
        # What users do: combine new and old states leaf by leaf.
        jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6), got, want)


def test_one_structure_with_two_treedefs_falls_back_to_the_structure():
    # {1: x} and {"1": x} print alike: a deserialized module cannot tell which it is.
    m_int = fcir.capture(lambda x: {1: x}, jnp.ones(2), name="int_keys")
    fcir.capture(lambda x: {"1": x}, jnp.ones(2), name="str_keys")
    assert list(reference.run(m_int, jnp.ones(2))) == [1]  # the captured module knows
    reread = Module.deserialize(m_int.serialize())
    assert pytrees.result_treedef(reread.main) is None
    assert list(reference.run(reread, jnp.ones(2))) == ["1"]
