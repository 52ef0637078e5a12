"""``fcir.interpreters.flower.Client``: a captured round's client work inside a Flower
user's own ClientApp, on the data the user loads.

::

    work = flower.Client(module, evaluation=evaluation_module)

    @app.train()
    def train(msg, context):
        x, y = load_data(context.node_config["partition-id"])
        return work.train(msg, x, y)

The reply is Flower's layout: the client outputs the round aggregates in an
``ArrayRecord`` under ``arrays`` and a ``MetricRecord`` under ``metrics`` with
``num-examples`` (the leading axis of the first data array unless given), which is what
``flower.Strategy`` (and Flower's consistency checks) read.

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
from .parts import RoundParts

__all__ = ["Client"]


class Client:
    """The client side of ``module`` (one round, one exchange) and, optionally, of a
    captured ``fcir.evaluation(program)``. Data arguments are the round's client data
    for one client (the member's arrays, without the leading axis of members), in the
    order the round takes them; pytrees are flattened.

    ``device_runtime``: ``"jax"`` (default) runs the client work from its jax.export
    artifact; ``"iree"`` compiles it with IREE for ``device_targets`` (default the
    host's ``llvm-cpu``), checks each module against XLA on seeded inputs (ExportError
    naming the part when none matches), and runs this host's module (or node config
    ``device-target``'s, given as ``device_target``) through IREE's runtime, with no
    jax call. Needs iree-base-compiler and iree-base-runtime (the ``iree`` extra)."""

    def __init__(
        self, module: Module, *, evaluation: Module | None = None, device_runtime: str = "jax",
        device_targets=(), device_target: str | None = None,
    ):
        if device_runtime not in ("jax", "iree"):
            raise ExportError(f"flower.Client: device_runtime {device_runtime!r}: choose jax or iree")
        if device_runtime != "iree" and (device_targets or device_target):
            raise ExportError("flower.Client: device_targets/device_target go with device_runtime='iree'")
        iree = dict(device_targets=list(device_targets), device_target=device_target)
        kw = iree if device_runtime == "iree" else {}
        self.device_runtime = device_runtime
        self.parts = RoundParts(module, "flower.Client", **kw)
        self.evaluation = (
            None if evaluation is None
            else RoundParts(evaluation, "flower.Client(evaluation=...)", **kw)
        )

    def train(self, msg: Message, *data, num_examples: int | None = None, metrics=None) -> Message:
        """Runs the round's client work on the arrays in ``msg`` and ``data``; the reply.
        ``metrics``: more numbers for the reply's MetricRecord (Flower averages them
        only in its own strategies; flower.Strategy's metrics are the round's)."""
        return self._reply(self.parts, msg, data, num_examples, metrics)

    def evaluate(self, msg: Message, *data, num_examples: int | None = None) -> Message:
        """Runs the evaluation's client work (``fcir.evaluation``) on ``msg`` and ``data``."""
        if self.evaluation is None:
            raise ExportError(
                "flower.Client.evaluate: give the captured evaluation, "
                "flower.Client(module, evaluation=fcir.capture(fcir.evaluation(round), ...))"
            )
        return self._reply(self.evaluation, msg, data, num_examples, None)

    @staticmethod
    def _reply(parts: RoundParts, msg: Message, data, num_examples, metrics) -> Message:
        leaves = jax.tree_util.tree_leaves(data)
        records = msg.content.array_records
        if not records:
            raise ExportError("flower.Client: the message carries no ArrayRecord (sent by flower.Strategy?)")
        record = records.get("arrays") or next(iter(records.values()))
        outputs = parts.client(runtime.from_record(record), leaves)
        n = examples_in(data) if num_examples is None else int(num_examples)
        content = RecordDict({
            "arrays": runtime.to_record(outputs),
            "metrics": MetricRecord({**(metrics or {}), "num-examples": n}),
        })
        return Message(content, reply_to=msg)
