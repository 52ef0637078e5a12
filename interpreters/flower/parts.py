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

import json
import threading

import numpy as np

from fcir.errors import ExportError
from fcir.frontend.pytrees import leaf_names
from fcir.ir import Module

from . import as_flower
from .app import runtime, training
from .app_writer import build_plan

__all__ = ["RoundParts", "from_reply", "model_reply", "record_of"]


class RoundParts:
    """``module`` (one round, one exchange) split into server and client parts.

    ``server_inputs`` / ``client_inputs`` / ``outputs``: the plan's specs (dtype,
    shape, pytree path; outputs also the program's own ``name``); ``output_names``: the
    outputs' names in output order (``train_loss``, else ``arr_<o>``). ``jit``: the
    client work runs as one compiled function (the bits of ``jax.jit``), else op by op
    (``as_flower.op_by_op``)."""

    def __init__(
        self, module: Module, who: str = "fcir.interpreters.flower", device_targets=None,
        device_target: str | None = None, *, jit: bool = True,
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
        self.who = who
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
        self.jit = bool(jit)
        self._op_by_op = None  # the client work op by op (jit=False), made on first use

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

    def _call_op_by_op(self, part: dict, env: dict) -> None:
        """``_call`` of the client work with ``jit=False``."""
        with self._lock:
            if self._op_by_op is None:
                self._op_by_op = as_flower.op_by_op(self.module)
        outs = self._op_by_op(*[env[tuple(p)] for p in part["params"]])
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
        (self._call if self.jit else self._call_op_by_op)(part, env)
        return {f"{g}/{n}": env[(g, n)] for g, n in part["results"]}

    def state(self, given: dict | None = None) -> dict[int, int]:
        """``{server input position: output position}``: which outputs become the next
        round's global arrays. ``given`` as is; else the outputs at the server inputs'
        pytree paths, else the first unused outputs of the server inputs' types."""
        if given is not None:
            return {int(i): int(o) for i, o in given.items()}
        mapping = training.infer(self.plan)
        used = set(mapping.values())
        for i, s in enumerate(self.server_inputs):
            if i in mapping:
                continue
            o = next(
                (o for o, out in enumerate(self.outputs)
                 if o not in used and training._same_type(s, out)),
                None,
            )
            if o is None:
                raise ExportError(
                    f"{self.who}: no output of @{self.module.name} has the type of its "
                    f"server input {i} ({s['type']}, {s.get('path', '')}), so the round "
                    "cannot update the global arrays: return the new model from the round, "
                    "or give state={input: output}"
                )
            mapping[i] = o
            used.add(o)
        return dict(sorted(mapping.items()))

    def model(self, state: dict[int, int]) -> dict[str, str] | None:
        """Sent key -> the client output that is its new value, or None.

        Flower's clipping (``fixedclipping_mod``, the DP wrappers) takes a train
        reply's one ArrayRecord as the sent arrays' new values, key for key, and clips
        their difference. In the round's IR that is: each sent array is the broadcast of
        a server input, and the output that ``state`` makes that input's next value is
        an aggregation (a mean) of one client output, returned as it is: the trained
        model of a FedAvg round. None when a sent array is not a server input's
        broadcast, or its next value is computed further on the server."""
        from fcir.ir.nodes import value_numbering

        main = self.module.main
        named = {f"v{n}": v for v, n in value_numbering(main).items()}
        name_of = {v: k for k, v in named.items()}
        made_by = {r: op for op in main.body.ops for r in op.results}
        aggregation = {a["output"]: a for a in self.exchange["aggregations"]}
        group = {n: g for g, n in self.exchange["client"]["results"]}
        leaf_of = {s["leaf"]: i for i, s in enumerate(self.server_inputs)}
        model = {}
        for (_, src), (dst_group, dst) in self.exchange["send"]:
            op = made_by.get(named.get(src))
            if op is None or len(op.operands) != 1 or op.operands[0] not in main.body.params:
                return None
            i = leaf_of.get(main.body.params.index(op.operands[0]))
            if i not in state:
                return None
            returned = main.body.results[self.plan["output_order"][state[i]]]
            a = aggregation.get(name_of.get(returned))
            if a is None or a["inputs"][0] not in group:
                return None
            model[f"{dst_group}/{dst}"] = f"{group[a['inputs'][0]]}/{a['inputs'][0]}"
        return model if len(set(model.values())) == len(model) else None

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


# --- records in Flower's layout (flower.Strategy / flower.Client) ------------------------
#
# Flower's strategy wrappers and client mods read a message's arrays with
# ``ArrayRecord.to_numpy_ndarrays()``, which takes only Flower's own serialisation
# (``np.save`` bytes): DifferentialPrivacy*FixedClipping and ``fixedclipping_mod``
# raise ``TypeError: Unsupported serialization type`` on the exported app's raw
# arrays. A user's own app gets Flower's arrays; only dtypes np.save cannot carry
# (bfloat16, float8) stay raw, exact either way.

LAYOUT = "fcir"  # the reply's ConfigRecord with the client outputs the ArrayRecord leaves out


def record_of(values: dict):
    """``values`` (name -> array) as an ArrayRecord of Flower's numpy arrays."""
    from flwr.app import Array, ArrayRecord

    return ArrayRecord({
        k: Array(x) if x.dtype.isbuiltin else runtime.to_array(x)
        for k, x in ((k, np.asarray(v)) for k, v in values.items())
    })


def model_reply(outputs: dict, model: dict[str, str] | None) -> tuple:
    """(ArrayRecord, ConfigRecord) of a train reply: the model (``RoundParts.model``,
    sent key -> client output) under the sent arrays' keys, Flower's layout, and the
    other client outputs as raw bytes beside it. Without a model (None) the ArrayRecord
    is empty, so that Flower's clipping refuses the reply (its keys, or the number of
    its arrays, differ from the sent ones) rather than clip a client output that is not
    a model."""
    from flwr.app import ConfigRecord

    model = model or {}
    rest = {o: np.asarray(v) for o, v in outputs.items() if o not in model.values()}
    config = {
        # JSON strings, not lists: a ConfigRecord list must not be empty on the wire.
        "model": json.dumps(list(model.items())),
        "specs": json.dumps({o: [v.dtype.name, list(v.shape)] for o, v in rest.items()}),
    }
    config.update({o: runtime.to_array(v).data for o, v in rest.items()})
    return record_of({k: outputs[o] for k, o in model.items()}), ConfigRecord(config)


def from_reply(record, layout) -> dict:
    """A client's outputs (output key -> array) from its reply's ArrayRecord and its
    ``fcir`` ConfigRecord (``model_reply``), after whatever a mod or wrapper did to the
    arrays."""
    arrays = {k: runtime.from_array(a) for k, a in record.items()}
    if layout is None:
        return arrays
    outputs = {o: arrays[k] for k, o in json.loads(layout["model"])}
    for o, (dtype, shape) in json.loads(layout["specs"]).items():
        outputs[o] = np.frombuffer(layout[o], dtype=runtime.np_dtype(dtype)).reshape(shape)
    return outputs
