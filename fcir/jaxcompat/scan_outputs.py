"""A scan that stacks one value twice: one IR text, each JAX's own lowering of it.

Linearizing a ``lax.scan`` (a gradient of a gradient through one), JAX can find that a
residual of the scan is the very value one of its stacked outputs already holds. JAX
0.10.2 returns it from the scan twice; JAX 0.12 returns it once and hands the
output to both uses (``_scan_linearize`` calls ``pe.dedup_jaxpr_outputs``). XLA prices
the two forms differently (it fuses the value's elementwise producer into the update
of each stacked output that holds it), so ``jax.jit`` of the same gradient costs other
flops on the two versions (fedavg_transformer_grad: 4,484,791 and 4,397,092).

fcir's IR keeps 0.10.2's form on every JAX, and each backend lowers it as its JAX does:

- Capture (:func:`keeping_copies`): while fcir traces a program on JAX 0.12,
  ``_scan_linearize`` keeps its copies, as on 0.10.2. :data:`KEEP_COPIES` is a config
  state in JAX's trace context, so JAX's trace and linearization caches keep those
  traces apart from the ones ``jax.jit`` makes outside capture (tests/jaxcompat/test_scan_residuals.py).
- XLA (:func:`bind_scan`): on JAX 0.12, a scan whose body returns one value as two
  stacked outputs is bound with it once, the result standing for both (what
  ``_scan_linearize`` binds there); on 0.10.2 it is bound as it is, as 0.10.2 does.
  The rewrite is sound for any scan: both outputs stack the same per-iteration value.
"""

from __future__ import annotations

import contextlib
import sys

from jax._src import config, core
from jax._src.interpreters import ad
from jax._src.interpreters import partial_eval as pe
from jax._src.lax.control_flow import loops

__all__ = [
    "KEEP_COPIES",
    "MERGES",
    "bind_scan",
    "has_stacked_copies",
    "stacked_copies",
    "keeping_copies",
    "scan_p",
]

scan_p = loops.scan_p

#: True while fcir captures (see :func:`keeping_copies`).
KEEP_COPIES = config.bool_state(
    name="fcir_keep_scan_copies",
    default=False,
    help="Internal to fcir: set while fcir.capture traces a program, so that a "
    "linearized scan returns a residual that is also a stacked output twice, as JAX "
    "0.10.2 does (and JAX's trace caches keep those traces apart).",
    include_in_trace_context=True,
)

_SCAN_LINEARIZE = getattr(ad.primitive_linearizations.get(scan_p), "__code__", None)
_JAX_DEDUP = getattr(pe, "dedup_jaxpr_outputs", None)

#: Whether the running JAX's scan linearization returns a residual that is also a
#: stacked output once (JAX 0.12; read from the rule itself, not the version number), so
#: the XLA backend binds such scans merged.
MERGES = (
    _JAX_DEDUP is not None
    and _SCAN_LINEARIZE is not None
    and "dedup_jaxpr_outputs" in _SCAN_LINEARIZE.co_names
)


def _dedup_jaxpr_outputs(jaxpr, num_kept_prefix, fwdable_prefix=None):
    # Only the scan linearization's call, and only while capturing: every other caller
    # (jit's and compute_on's linearization, JAX outside capture) gets JAX's function.
    if KEEP_COPIES.value and sys._getframe(1).f_code is _SCAN_LINEARIZE:
        return jaxpr, [None] * len(jaxpr.outvars)
    return _JAX_DEDUP(jaxpr, num_kept_prefix, fwdable_prefix)


_HOOKED = MERGES
if _HOOKED:
    pe.dedup_jaxpr_outputs = _dedup_jaxpr_outputs


@contextlib.contextmanager
def keeping_copies():
    """The block traces with 0.10.2's linearized scans (on 0.10.2: as it is)."""
    if not _HOOKED:
        yield
        return
    with KEEP_COPIES(True):
        yield


def _copies(jaxpr, num_carry: int) -> list[int | None]:
    """For each result of scan body ``jaxpr``: the index of the earlier stacked output
    returning the same variable, or None (carries are final values: never merged)."""
    first: dict = {}
    out: list[int | None] = []
    for i, v in enumerate(jaxpr.outvars):
        if i < num_carry or not isinstance(v, core.Var):
            out.append(None)
            continue
        out.append(first.get(v))
        first.setdefault(v, i)
    return out


def _scan_jaxpr(params):
    jaxpr = params["jaxpr"]
    return getattr(jaxpr, "jaxpr", jaxpr)  # ClosedJaxpr (0.10) or Jaxpr (0.12)


def _num_carry(params) -> int:
    if "num_carry" in params:
        return int(params["num_carry"])
    return len(params["ft_out"].unpack()[0])


def bind_scan(args, params) -> list:
    """``scan_p.bind(*args, **params)`` (the running JAX's params) as the running JAX
    binds a scan: on JAX 0.12, stacked outputs returning one body variable once."""
    if not MERGES:
        return loops.scan_p.bind(*args, **params)
    num_carry = _num_carry(params)
    copies = _copies(_scan_jaxpr(params), num_carry)
    if all(c is None for c in copies):
        return loops.scan_p.bind(*args, **params)
    from jax._src import flattree as ft

    kept = [c is None for c in copies]
    jaxpr = pe.prune_jaxpr_outputs(params["jaxpr"], kept)
    ft_out = ft.pack((ft.nones(num_carry), ft.nones(sum(kept) - num_carry)))
    outs = loops.scan_p.bind(*args, **{**params, "jaxpr": jaxpr, "ft_out": ft_out})
    kept_outs = iter(outs)
    full = [next(kept_outs) if c is None else None for c in copies]
    return [full[c] if c is not None else x for x, c in zip(full, copies)]


def stacked_copies(closed) -> int:
    """How many stacked outputs of the scans in ``closed`` (nested anywhere) return a
    body variable an earlier stacked output of the same scan returns."""
    n, stack = 0, [getattr(closed, "jaxpr", closed)]
    while stack:
        for eqn in stack.pop().eqns:
            if eqn.primitive is scan_p:
                copies = _copies(_scan_jaxpr(eqn.params), _num_carry(eqn.params))
                n += sum(c is not None for c in copies)
            stack.extend(getattr(sub, "jaxpr", sub) for sub in core.jaxprs_in_params(eqn.params))
    return n


def has_stacked_copies(closed) -> bool:
    """Whether a scan in ``closed`` stacks one value twice and the running JAX binds it
    merged: then running that very jaxpr is not what the XLA backend runs for its IR
    (``fcir.frontend.jaxpr_cache`` must not hand it out)."""
    return MERGES and stacked_copies(closed) > 0
