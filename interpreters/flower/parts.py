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

from .app import runtime
from .writer import build_plan

__all__ = ["RoundParts"]


class RoundParts:
    """``module`` (one round, one exchange) split into server and client parts.

    ``server_inputs`` / ``client_inputs`` / ``outputs``: the plan's specs (dtype,
    shape, pytree path; outputs also the program's own ``name``); ``output_names``: the
    outputs' names in output order (``train_loss``, else ``arr_<o>``)."""

    def __init__(
        self, module: Module, who: str = "fcir.interpreters.flower", device_targets=None,
        device_target: str | None = None,
    ):
        if not isinstance(module, Module):
            raise ExportError(
                f"{who}: takes a captured round (fcir.capture(round, *args)), got "
                f"{type(module).__name__}"
            )
        # device_targets (a list): client work as IREE modules, compiled and verified
        # against XLA as `--device-runtime iree` exports do (writer.build_plan).
        plan, artifacts = build_plan(module, None if device_targets is None else list(device_targets))
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
        self.device_target = device_target  # node config device-target's role
        self._compiled: dict = {}
        self._lock = threading.Lock()

    # --- running the parts ----------------------------------------------------------

    def _call(self, part: dict, env: dict) -> None:
        if not part["results"]:
            return
        if "iree" in part:
            self._call_iree(part, env)
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

    def _call_iree(self, part: dict, env: dict) -> None:
        """``part`` through its IREE module for this host (or ``device_target``): no jax
        runs. Modules are cached per instance, not in iree_runtime's process-wide table,
        which is keyed by artifact name (``client_work@llvm-cpu``), the same for every
        round: two Clients in one process would share one module there."""
        from ..production import iree_runtime

        entry = part["iree"]
        target = iree_runtime.pick_target(entry["modules"], entry["host_arch"], self.device_target)
        key = entry["modules"][target]["file"]
        with self._lock:
            fn = self._compiled.get(key)
            if fn is None:
                fn = self._compiled[key] = iree_runtime.Module(self._artifacts[key])
        outs = fn(*[env[tuple(p)] for p in part["params"]])
        env.update(zip((tuple(r) for r in part["results"]), outs))

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
        self._call(part, env)
        return {f"{g}/{n}": env[(g, n)] for g, n in part["results"]}

    def finish(self, server_leaves, replies: list[dict]) -> list[np.ndarray]:
        """The round's outputs, in output order, from the server arrays and the client
        replies (each ``client``'s result; aggregated in the order given)."""
        env = self._server_env(server_leaves)
        self._call(self.prepare["part"], env)  # server values the last part reads again
        outs = [{k.partition("/")[2]: v for k, v in r.items()} for r in replies]
        for name, value in runtime.aggregate(self.exchange["aggregations"], outs).items():
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
