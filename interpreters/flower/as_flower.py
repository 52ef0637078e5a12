"""A round's parts computed as a Flower app computes them, for ``flower.Client`` and
``flower.Strategy`` inside a Flower user's own app, so that an app switched to fcir
keeps the bits it had:

- ``op_by_op``: the client work run as JAX runs a function it does not jit (Flower's
  JAX template trains so), each op on its own, instead of as one compiled function;
- ``fedavg_means``: a weighted mean computed as Flower's ``FedAvg`` computes its
  average, instead of fcir's ``sum(w * x) / sum(w)``.

Both are a last-bit matter: XLA compiles a training step as a whole (1-2 float32 ulps
from the eager one after 10 epochs of the template), and the two means round
differently.
"""

from __future__ import annotations

import functools

import numpy as np

from fcir.base_interpreter import Interpreter
from fcir.ir import Func, Module

from ..production import intrinsics
from ..production.splitting import split
from .phases import split_phases

__all__ = ["WEIGHTED_MEAN", "fedavg_means", "op_by_op"]

# The weighted mean's aggregation in a plan (the production split's intrinsic).
WEIGHTED_MEAN = intrinsics.WEIGHTED_MEAN


def op_by_op(module: Module):
    """``fn(*leaves) -> results``: the client work of ``module`` (one round, one
    exchange) with each op bound on its own, outside any trace, as the reference
    interpreter runs local ops and as JAX runs a function it does not jit. The code is
    the client work of the production split (one member's ops, no fed op) that the
    plan's ``client_work`` artifact is lowered from: the same parameters and results,
    in the same order."""
    member = split(split_phases(module)[0].module).client_member
    flat = Module(member.name, member.placements, [Func("main", member.main.body)])
    return functools.partial(Interpreter().run, flat)


def fedavg_means(aggregations: list[dict], replies: list[dict]) -> dict[str, np.ndarray]:
    """The plan's weighted means (``aggregations``: an exchange's) over ``replies``
    (client results, ``"group/name" -> array``) that Flower's FedAvg can compute,
    computed as it computes its average (``aggregate_arrayrecords``), in the order
    given (the order FedAvg takes its replies in): each client's weight divided by
    their total in Python floats, each value times its factor in the value's dtype,
    the products added one by one in that dtype. Those are means of float values with
    one weight per client and a positive total; the others (weights per element,
    integers, a zero total, which FedAvg refuses) are not in the result, for fcir's
    own aggregation. By aggregation output name."""
    outs = [{k.partition("/")[2]: v for k, v in r.items()} for r in replies]
    means = {}
    for agg in aggregations:
        if agg.get("aggregate") != WEIGHTED_MEAN or len(agg["inputs"]) != 2 or not outs:
            continue
        xs = [np.asarray(r[agg["inputs"][0]]) for r in outs]
        ws = [np.asarray(r[agg["inputs"][1]]) for r in outs]
        if xs[0].dtype.kind != "f" or any(w.size != 1 for w in ws):
            continue
        weights = [w.reshape(()).item() for w in ws]
        total = sum(weights)
        if not (np.isfinite(total) and total > 0):
            continue
        mean = None
        for x, w in zip(xs, weights):
            # A Python float times an array is computed in the array's dtype (NEP 50).
            term = x * (w / total)
            mean = term if mean is None else mean + term
        means[agg["output"]] = np.asarray(mean, xs[0].dtype)
    return means
