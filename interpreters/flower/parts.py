"""A captured round's three parts, in this process: what the server sends, what each
client computes, and how the server finishes the round from the replies.

The same split and artifacts as an exported app's plan.json (``writer.build_plan``),
held in memory, for a round used inside a Flower user's own app
(``flower.Strategy`` on the server, ``flower.Client`` in the ClientApp). Only rounds
with one broadcast/aggregate exchange fit Flower's one ``train`` message per round; a
round with several, or a whole training program, is exported with ``fcir export
--target flower`` instead.
"""

from __future__ import annotations

import threading

import numpy as np

from fcir.errors import ExportError
from fcir.frontend.pytrees import leaf_names
from fcir.ir import Module

from . import as_flower
from .app import runtime
from .writer import build_plan

__all__ = ["RoundParts"]


class RoundParts:
    """``module`` (one round, one exchange) split into server and client parts.

    ``server_inputs`` / ``client_inputs`` / ``outputs``: the plan's specs (dtype,
    shape, pytree path; outputs also the program's own ``name``); ``output_names``: the
    outputs' names in output order (``train_loss``, else ``arr_<o>``). ``jit``: the
    client work runs as one compiled function (the bits of ``jax.jit``), else op by op
    (``as_flower.op_by_op``)."""

    def __init__(self, module: Module, who: str = "fcir.interpreters.flower", *, jit: bool = True):
        if not isinstance(module, Module):
            raise ExportError(
                f"{who}: takes a captured round (fcir.capture(round, *args)), got "
                f"{type(module).__name__}"
            )
        plan, artifacts = build_plan(module)
        kinds = [s["kind"] for s in plan.get("steps", ())]
        if "loop" in plan or kinds != ["server", "exchange", "server"]:
            raise ExportError(
                f"{who}: @{module.name} is not one round with one exchange (it "
                + ("loops over rounds" if "loop" in plan else f"has {kinds.count('exchange')} exchanges")
                + "): a Flower strategy runs one train exchange per round; capture a "
                "single round, or export the whole program with fcir export --target flower"
            )
        self.module = module
        self.plan = plan
        self.prepare, self.exchange, self.result = plan["steps"]
        self.server_inputs = plan["server_inputs"]
        self.client_inputs = plan["client_inputs"]
        self.outputs = [plan["outputs"][j] for j in plan["output_order"]]
        names = leaf_names(module.main.result_structure, len(plan["outputs"]))
        self.output_names = [names[j] if not names[j].startswith("arr_") else f"arr_{o}"
                             for o, j in enumerate(plan["output_order"])]
        self._artifacts = artifacts
        self._compiled: dict = {}
        self._lock = threading.Lock()
        self.jit = bool(jit)
        self._op_by_op = None  # the client work op by op (jit=False), made on first use

    # --- running the parts ----------------------------------------------------------

    def _call(self, part: dict, env: dict) -> None:
        if not part["results"]:
            return
        with self._lock:
            fn = self._compiled.get(part["artifact"])
            if fn is None:
                import jax

                exp = jax.export.deserialize(bytearray(self._artifacts[part["artifact"]]))
                specs = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in exp.in_avals]
                fn = self._compiled[part["artifact"]] = jax.jit(exp.call).lower(*specs).compile()
        outs = fn(*[env[tuple(p)] for p in part["params"]])
        env.update(zip((tuple(r) for r in part["results"]), (np.asarray(x) for x in outs)))

    def _call_op_by_op(self, part: dict, env: dict) -> None:
        """``_call`` of the client work with ``jit=False``."""
        with self._lock:
            if self._op_by_op is None:
                self._op_by_op = as_flower.op_by_op(self.module)
        outs = self._op_by_op(*[env[tuple(p)] for p in part["params"]])
        env.update(zip((tuple(r) for r in part["results"]), (np.asarray(x) for x in outs)))

    def _server_env(self, server_leaves) -> dict:
        leaves = list(server_leaves)
        if len(leaves) != len(self.server_inputs):
            raise ExportError(
                f"@{self.module.name} takes {len(self.server_inputs)} server array(s) ("
                + ", ".join(s["type"] for s in self.server_inputs)
                + f"), got {len(leaves)}"
            )
        return {
            ("arg", str(s["leaf"])): runtime.check_leaf(x, s, f"server array {i} {s.get('path', '')}")
            for i, (s, x) in enumerate(zip(self.server_inputs, leaves))
        }

    def send(self, server_leaves) -> dict[str, np.ndarray]:
        """What the server sends every sampled client: ``"group/name" -> array``."""
        env = self._server_env(server_leaves)
        self._call(self.prepare["part"], env)
        return {f"{dst[0]}/{dst[1]}": env[tuple(src)] for src, dst in self.exchange["send"]}

    def client(self, sent: dict, client_leaves) -> dict[str, np.ndarray]:
        """One client's work on the arrays the server sent and its own data leaves (the
        round's client arguments for one member, in leaf order)."""
        leaves = list(client_leaves)
        if len(leaves) != len(self.client_inputs):
            raise ExportError(
                f"@{self.module.name}'s client work takes {len(self.client_inputs)} data "
                "array(s) for one client ("
                + ", ".join(runtime.describe(runtime.np_dtype(s["dtype"]), s["shape"])
                            for s in self.client_inputs)
                + f"), got {len(leaves)}"
            )
        env = {
            ("arg", str(s["leaf"])): runtime.check_leaf(_as_jax_would(x, s), s, f"client data array {i}")
            for i, (s, x) in enumerate(zip(self.client_inputs, leaves))
        }
        for key, x in sent.items():
            group, _, name = key.partition("/")
            env[(group, name)] = x
        part = self.exchange["client"]
        (self._call if self.jit else self._call_op_by_op)(part, env)
        return {f"{g}/{n}": env[(g, n)] for g, n in part["results"]}

    def finish(self, server_leaves, replies: list[dict], aggregated=None) -> list[np.ndarray]:
        """The round's outputs, in output order, from the server arrays and the client
        replies (each ``client``'s result; aggregated in the order given).
        ``aggregated``: aggregation outputs computed already (``as_flower.fedavg_means``),
        by name; the others are aggregated here."""
        env = self._server_env(server_leaves)
        self._call(self.prepare["part"], env)  # server values the last part reads again
        outs = [{k.partition("/")[2]: v for k, v in r.items()} for r in replies]
        given = dict(aggregated or {})
        rest = [a for a in self.exchange["aggregations"] if a["output"] not in given]
        for name, value in {**runtime.aggregate(rest, outs), **given}.items():
            env[(self.exchange.get("aggregated", "aggregated"), name)] = np.asarray(value)
        self._call(self.result["part"], env)
        results = [np.asarray(env[("output", str(j))]) for j in range(len(self.plan["outputs"]))]
        return [results[j] for j in self.plan["output_order"]]


def _as_jax_would(x, spec: dict) -> np.ndarray:
    """``x`` in the dtype the round takes where JAX (64-bit off) would convert it too:
    numpy's float64 data for a float32 argument, as a jax function called on it sees it."""
    x = np.asarray(x)
    want = runtime.np_dtype(spec["dtype"])
    if x.dtype != want and x.dtype.kind == want.kind and x.dtype.itemsize > want.itemsize:
        import jax

        if not jax.config.jax_enable_x64:
            return x.astype(want)
    return x
