"""A program's federated evaluation (``fcir.program(evaluate=fn)``) as a program.

Flower's evaluate stage sends the global model to a sample of clients, each returns
its metrics and its number of examples, and the server takes their weighted mean.
``evaluation(program)`` is that computation written in fcir: broadcast the server
values, ``fn`` at every member, ``reduce_weighted_mean`` by each member's number of
examples (the leading axis of its first data array). Captured, it runs on every backend
(``reference.run``, ``xla.compile``) and in a Flower app's evaluate stage, with the same
metrics for the same members.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from fcir.errors import PlacementError
from fcir.fed.broadcast import broadcast
from fcir.fed.map import map_fn
from fcir.fed.weighted_mean import reduce_weighted_mean
from fcir.opkit.placement import program as fcir_program

__all__ = ["evaluation", "num_examples"]


def num_examples(data) -> int:
    """One client's number of examples: the leading axis of its first data array."""
    leaves = jax.tree_util.tree_leaves(data)
    if not leaves or not np.shape(leaves[0]):
        raise PlacementError(
            "fcir.evaluation: a client's first data argument must be an array with one "
            "row per example (its leading axis is the client's number of examples, "
            "Flower's num-examples)"
        )
    return int(np.shape(leaves[0])[0])


def evaluation(program: Callable) -> Callable:
    """The federated evaluation ``program`` declares with ``fcir.program(evaluate=fn)``:
    a program with ``fn``'s arguments (server values; client data with a leading axis
    of members, as the round takes them) returning ``fn``'s named metrics, each the mean
    over the members weighted by their numbers of examples.

    ``{name: f32[]}@server`` from ``fn``'s ``{name: scalar}`` per member."""
    fn = getattr(program, "fcir_evaluate", None)
    spec = getattr(program, "fcir_placements", None)
    if fn is None or spec is None:
        raise PlacementError(
            f"fcir.evaluation: {getattr(program, '__name__', program)!r} declares no "
            "evaluation: write @fcir.program(..., client_data=(...), evaluate=fn) with "
            "fn(params, x, y) -> {'test_loss': ...}"
        )
    if len(spec.names) != 1:
        raise PlacementError(
            f"fcir.evaluation: {program.__name__} has a placement hierarchy "
            f"{list(spec.names)}; an evaluation weights the members of one placement"
        )
    data = {name for _, name in program.fcir_client_data}
    params = [
        p.name for p in inspect.signature(fn).parameters.values()
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
    ]
    held = [p for p in params if p in data]
    if not held:
        raise PlacementError(
            f"fcir.evaluation: {fn.__name__}({', '.join(params)}) takes none of "
            f"{program.__name__}'s client data {sorted(data)}: name its data arguments as "
            "the round does"
        )
    first = params.index(held[0])

    def member(*args):
        metrics = fn(*args)
        if not isinstance(metrics, dict) or not metrics:
            raise PlacementError(
                f"fcir.evaluation: {fn.__name__} must return a dict of named scalar "
                f"metrics, e.g. {{'test_loss': loss}}, got {type(metrics).__name__}"
            )
        for name, value in metrics.items():
            if np.shape(value) != ():
                raise PlacementError(
                    f"fcir.evaluation: metric {name!r} of {fn.__name__} has shape "
                    f"{np.shape(value)}; a metric is one number per client"
                )
        metrics = {k: jnp.asarray(v, jnp.float32) for k, v in metrics.items()}
        return metrics, jnp.float32(num_examples(args[first]))

    @functools.wraps(fn)
    def evaluate(*args):
        placed = tuple(a if params[i] in data else broadcast(a) for i, a in enumerate(args))
        metrics, weights = map_fn(member, placed)
        return reduce_weighted_mean(metrics, weights)

    placements = dict(zip(spec.names, spec.sizes))
    return fcir_program(placements=placements, client_data=tuple(held))(evaluate)
