"""``fcir.interpreters.flower.Client``: a captured round's client work inside a Flower
user's own ClientApp, on the data the user loads.

::

    work = flower.Client(module, evaluation=evaluation_module)

    @app.train()
    def train(msg, context):
        x, y = load_data(context.node_config["partition-id"])
        return work.train(msg, x, y)

The reply is Flower's layout: one ``ArrayRecord`` under ``arrays`` with the trained
model under the keys of the arrays the server sent (so Flower's ``fixedclipping_mod``
and DP wrappers clip it), a ``MetricRecord`` under ``metrics`` with ``num-examples``
(the leading axis of the first data array unless given), and the round's other client
outputs (losses, weights) as raw bytes in a ``ConfigRecord`` under ``fcir``, which is
what ``flower.Strategy`` (and Flower's consistency checks) read. A round whose client
outputs hold no such model replies with an empty ``arrays`` and every client output
under ``fcir``, which Flower's clipping refuses. Evaluate replies carry the
evaluation's client outputs in ``arrays``.

``flower.Client(module, device_runtime="iree")`` runs the client work as IREE modules
instead, compiled and verified against XLA when the Client is made, as ``fcir export
--target flower --device-runtime iree`` does (docs/flower_app.md, "Client work on IREE").
"""

from __future__ import annotations

import jax
from flwr.app import Message, MetricRecord, RecordDict

from fcir.errors import ExportError
from fcir.frontend.evaluation import num_examples as examples_in
from fcir.ir import Module

from .app import runtime
from .parts import LAYOUT, RoundParts, model_reply, record_of

__all__ = ["Client"]


class Client:
    """The client side of ``module`` (one round, one exchange) and, optionally, of a
    captured ``fcir.evaluation(program)``. Data arguments are the round's client data
    for one client (the member's arrays, without the leading axis of members), in the
    order the round takes them; pytrees are flattened. ``state``: flower.Strategy's
    (which outputs become the global arrays), when the ServerApp gives one: it says
    which client outputs are the model the reply carries under the sent keys.

    ``jit``: the client work runs as one compiled function, with the bits of
    ``jax.jit`` of the round's local function; ``jit=False`` runs it op by op, as JAX
    runs a function it does not jit (Flower's JAX template trains so), for the bits a
    ClientApp that trained eagerly had (``as_flower``). JAX compiles a few
    ``jax.numpy`` helpers (``jnp.mean``) as one unit even then: a value computed inside
    one can differ in its last bit.

    ``device_runtime``: ``"jax"`` (default) runs the client work from its jax.export
    artifact; ``"iree"`` compiles it with IREE for ``device_targets`` (default the
    host's ``llvm-cpu``), checks each module against XLA on seeded inputs (ExportError
    naming the part when none matches), and runs this host's module (or node config
    ``device-target``'s, given as ``device_target``) through IREE's runtime, with no
    jax call. Needs iree-base-compiler and iree-base-runtime (the ``iree`` extra)."""

    def __init__(
        self, module: Module, *, evaluation: Module | None = None,
        state: dict[int, int] | None = None, jit: bool = True, device_runtime: str = "jax",
        device_targets=(), device_target: str | None = None,
    ):
        if device_runtime not in ("jax", "iree"):
            raise ExportError(f"flower.Client: device_runtime {device_runtime!r}: choose jax or iree")
        if device_runtime != "iree" and (device_targets or device_target):
            raise ExportError("flower.Client: device_targets/device_target go with device_runtime='iree'")
        if device_runtime == "iree" and not jit:
            raise ExportError(
                "flower.Client: jit=False runs the client work op by op with jax; "
                "device_runtime='iree' runs it as compiled IREE modules: choose one"
            )
        iree = dict(device_targets=list(device_targets), device_target=device_target)
        kw = iree if device_runtime == "iree" else {}
        self.device_runtime = device_runtime
        self.parts = RoundParts(module, "flower.Client", jit=jit, **kw)
        # The client outputs that are the sent arrays' new values (flower.Strategy's
        # state=, which this takes too): the reply's ArrayRecord.
        try:
            self.model = self.parts.model(self.parts.state(state))
        except ExportError:  # no global arrays to pair (flower.Strategy refuses the round)
            self.model = None
        self.evaluation = (
            None if evaluation is None
            else RoundParts(evaluation, "flower.Client(evaluation=...)", jit=jit, **kw)
        )

    def train(self, msg: Message, *data, num_examples: int | None = None, metrics=None) -> Message:
        """Runs the round's client work on the arrays in ``msg`` and ``data``; the reply.
        ``metrics``: more numbers for the reply's MetricRecord (Flower averages them
        only in its own strategies; flower.Strategy's metrics are the round's)."""
        return self._reply(self.parts, msg, data, num_examples, metrics, self.model or {})

    def evaluate(self, msg: Message, *data, num_examples: int | None = None) -> Message:
        """Runs the evaluation's client work (``fcir.evaluation``) on ``msg`` and ``data``."""
        if self.evaluation is None:
            raise ExportError(
                "flower.Client.evaluate: give the captured evaluation, "
                "flower.Client(module, evaluation=fcir.capture(fcir.evaluation(round), ...))"
            )
        return self._reply(self.evaluation, msg, data, num_examples, None, None)

    @staticmethod
    def _reply(parts: RoundParts, msg: Message, data, num_examples, metrics, model) -> Message:
        leaves = jax.tree_util.tree_leaves(data)
        records = msg.content.array_records
        if not records:
            raise ExportError("flower.Client: the message carries no ArrayRecord (sent by flower.Strategy?)")
        record = records.get("arrays") or next(iter(records.values()))
        sent = runtime.from_record(record)
        outputs = parts.client(sent, leaves)
        n = examples_in(data) if num_examples is None else int(num_examples)
        # A train reply's one ArrayRecord is the new model under the sent keys, as in
        # Flower's own apps, so that fixedclipping_mod and the DP wrappers clip it.
        arrays, layout = model_reply(outputs, model) if model is not None else (record_of(outputs), None)
        content = RecordDict({
            "arrays": arrays,
            "metrics": MetricRecord({**(metrics or {}), "num-examples": n}),
        })
        if layout is not None:
            content[LAYOUT] = layout
        return Message(content, reply_to=msg)
