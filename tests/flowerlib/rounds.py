"""Corpus rounds bound to the deployment's client count, their data split per node, and
the results the Flower runs must equal."""

from __future__ import annotations

import dataclasses
import functools
import json
import pathlib

import jax
import numpy as np
from corpus import case
from fcir.interpreters import flower, production, reference

import fcir
from fcir.ir.types import SERVER, PlacedType

NODES = 3


def rebind(module: fcir.Module, clients: int) -> fcir.Module:
    """``module`` with ``clients`` clients: placed types name the placement, only the
    module's placement list holds its size."""
    (name, _), *rest = module.placements
    return dataclasses.replace(module, placements=[(name, clients), *rest])


@dataclasses.dataclass
class Round:
    name: str
    module: fcir.Module
    leaves: list  # the round's argument leaves, client leaves cut to NODES rows
    is_client: list[bool]

    @property
    def server_leaves(self) -> list:
        return [x for x, c in zip(self.leaves, self.is_client) if not c]

    def node_leaves(self, plan: dict, node: int) -> list:
        return [np.asarray(self.leaves[s["leaf"]][node]) for s in plan["client_inputs"]]

    def write_node_data(self, appdir, root) -> list[pathlib.Path]:
        plan = json.loads((pathlib.Path(appdir) / "fcir_app/plan.json").read_text())
        paths = []
        for i in range(NODES):
            p = pathlib.Path(root) / f"{self.name}-node{i}.npz"
            np.savez(p, *self.node_leaves(plan, i))
            paths.append(p)
        return paths


def client_params(module: fcir.Module) -> list[bool]:
    """For each of the round's argument leaves, whether it is placed at the clients."""
    return [
        isinstance(v.type, PlacedType) and v.type.placement != SERVER
        for v in module.main.body.params
    ]


@functools.cache
def corpus_round(name: str, clients: int = NODES) -> Round:
    c = case(name)
    args = c.make_args()
    module = rebind(fcir.capture(c.fn, *args), clients)
    leaves = jax.tree.leaves(args)
    is_client = client_params(module)
    leaves = [np.asarray(x)[:clients] if cl else np.asarray(x) for x, cl in zip(leaves, is_client)]
    return Round(name, module, leaves, is_client)


def output_order(module) -> list[int]:
    s = module.main.result_structure
    return s.leaves() if s is not None else list(range(len(module.main.body.results)))


def bundle_outputs(r: Round, directory) -> list:
    """``production.run_bundle``'s outputs in the ``fcir run-plan -o`` leaf layout."""
    return bundle_rounds(r, directory, 1)


def bundle_rounds(r: Round, directory, rounds: int) -> list:
    """The outputs of ``rounds`` rounds of ``production.run_bundle`` (each round's
    outputs, in order, the next round's first server leaves; a server leaf past them,
    such as a key, stays as it is), in ``bundle_outputs``' layout. One export and one
    Bundle: its parts compile once, not once per round."""
    production.export(r.module).write(directory)
    bundle = production.Bundle(directory)
    leaves = list(r.leaves)
    server = [i for i, c in enumerate(r.is_client) if not c]
    for _ in range(rounds):
        flat = bundle.run_flat(leaves)
        outs = [np.asarray(flat[i]) for i in output_order(r.module)]
        for i, out in zip(server, outs):
            leaves[i] = out
    return outs


def module_reference_outputs(module: fcir.Module, args) -> list:
    """``reference.run(module, *args)``'s leaves in the order the app writes them."""
    flat = jax.tree.leaves(reference.run(module, *args))
    return [np.asarray(flat[i]) for i in output_order(module)]


def reference_outputs(r: Round, leaves=None) -> list:
    return module_reference_outputs(r.module, leaves or r.leaves)


def export(r: Round, appdir) -> pathlib.Path:
    return flower.export(r.module, appdir, inputs=r.server_leaves)


def plan_of(appdir) -> dict:
    return json.loads((pathlib.Path(appdir) / "fcir_app/plan.json").read_text())


def first_clients(r: Round, k: int) -> Round:
    """``r`` on its first ``k`` clients only."""
    leaves = [x[:k] if c else x for x, c in zip(r.leaves, r.is_client)]
    return dataclasses.replace(r, module=rebind(r.module, k), leaves=leaves)


def corpus_module(name: str) -> fcir.Module:
    c = case(name)
    return fcir.capture(c.fn, *c.make_args())
