"""Users' program files for tests of the errors they meet: written to a temporary
folder, loaded as the user's own module, and two mistakes a newcomer makes (a Python
``if`` in a client function, numpy on a traced value at the server)."""

from __future__ import annotations

import importlib.util
import textwrap

import jax.numpy as jnp

N = 4
ARGS = (jnp.zeros(3), jnp.ones((N, 5, 3)))

PY_IF_IN_A_CLIENT = """
@fcir.program(placements={"clients": 4})
def rnd(w, x):
    def local(w, x):
        if jnp.sum(x) > 0:
            return w + 1
        return w
    return fcir.reduce_mean(fcir.map_fn(local, (fcir.broadcast(w), x)))
"""

NUMPY_AT_THE_SERVER = """
@fcir.program(placements={"clients": 4})
def rnd(w, x):
    w = np.tanh(w)
    upd = fcir.map_fn(lambda w, x: w + x.mean(0), (fcir.broadcast(w), x))
    return fcir.reduce_mean(upd)
"""


def write_program(tmp_path, body: str, name: str = "mine.py"):
    """A user's file ``name`` with ``body`` after the imports; returns its path."""
    path = tmp_path / name
    path.write_text(
        "import jax, jax.numpy as jnp\nimport numpy as np\nimport fcir\n\n" + textwrap.dedent(body)
    )
    return path


def load(path, name):
    """Function ``name`` of the user's file ``path``, imported as its own module."""
    spec = importlib.util.spec_from_file_location(f"_user_{path.stem}_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return getattr(module, name)
