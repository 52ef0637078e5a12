"""``fcir.interpreters.flower.Strategy``: a captured round as a Flower strategy.

A Flower user keeps the ServerApp they have and swaps the strategy::

    strategy = flower.Strategy(module, evaluation=fcir.capture(fcir.evaluation(rnd), ...))
    result = strategy.start(grid=grid, initial_arrays=arrays, num_rounds=3,
                            evaluate_fn=global_evaluate)

It is Flower's ``FedAvg`` (sampling with ``fraction_train`` / ``min_train_nodes`` /
``min_available_nodes``, the ``arrays`` / ``metrics`` / ``config`` records, the
consistency checks on replies, Flower's log lines and its "Final results") with the
round's own server work in place of the weighted average: ``configure_train`` runs the
round's server part before the exchange on the global arrays and sends what it
broadcasts; each ClientApp runs the round's client work (``flower.Client``) and replies
with the trained model under the sent keys, its other client outputs and
``num-examples``; ``aggregate_train`` runs the round's aggregations and server part
after them, over the replies that came (a robust aggregate below the fewest replies it
is defined for skips the round, as Flower's ``Bulyan`` does). A ``reduce_weighted_mean``
of float values by one weight per client is FedAvg's average and is computed as FedAvg
computes it (each weight over the total in Python floats, the products added in the
values' dtype, in the order the replies came), so a round that is FedAvg gives FedAvg's
bits; the other aggregations are fcir's, over the replies in node order. The outputs
that feed the round's server inputs become the next global arrays; the other
scalar outputs are the round's metrics, by the program's own names (``train_loss``).

Flower's wrappers take it as they take FedAvg: ``DifferentialPrivacyServerSideFixedClipping``,
and ``DifferentialPrivacyClientSideFixedClipping`` with ``fixedclipping_mod`` on the
ClientApp's train handler, clip the replies' model updates before the round's
aggregation and add noise to its result (docs/flower_app.md). SecAgg+ takes only
Flower's legacy strategies in flwr 1.42.

With ``evaluation`` (a captured ``fcir.evaluation(program)``), Flower's evaluate stage
runs it the same way; without, Flower's own evaluate stage runs the user's
``@app.evaluate`` and averages its metrics by ``num-examples``, as FedAvg does.
"""

from __future__ import annotations

from collections.abc import Iterable
from logging import INFO, WARN

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord
from flwr.serverapp import Grid
from flwr.serverapp.strategy import FedAvg
from flwr.supercore import log

from fcir.ir import Module

from . import as_flower
from .app import runtime
from .parts import LAYOUT, RoundParts, from_reply, record_of

__all__ = ["Strategy"]


class Strategy(FedAvg):
    """Flower's FedAvg with ``module``'s round (one exchange) as the server's work.

    ``evaluation``: a captured ``fcir.evaluation(program)`` for the evaluate stage, or
    None (the user's ``@app.evaluate``). ``state``: ``{server input position: output
    position}``, which outputs become the next round's global arrays; default: the
    outputs at the server inputs' pytree paths, else the first outputs of the server
    inputs' types, in order. The other arguments are FedAvg's, with its defaults."""

    def __init__(
        self,
        module: Module,
        *,
        evaluation: Module | None = None,
        state: dict[int, int] | None = None,
        fraction_train: float = 1.0,
        fraction_evaluate: float = 1.0,
        min_train_nodes: int = 2,
        min_evaluate_nodes: int = 2,
        min_available_nodes: int = 2,
        weighted_by_key: str = "num-examples",
        arrayrecord_key: str = "arrays",
        configrecord_key: str = "config",
    ) -> None:
        super().__init__(
            fraction_train=fraction_train,
            fraction_evaluate=fraction_evaluate,
            min_train_nodes=min_train_nodes,
            min_evaluate_nodes=min_evaluate_nodes,
            min_available_nodes=min_available_nodes,
            weighted_by_key=weighted_by_key,
            arrayrecord_key=arrayrecord_key,
            configrecord_key=configrecord_key,
        )
        self.parts = RoundParts(module, "flower.Strategy")
        self.evaluation = None if evaluation is None else RoundParts(evaluation, "flower.Strategy(evaluation=...)")
        self.state = self.parts.state(state)
        # The global arrays of each round as the user keyed them, and the round's named
        # outputs (all of them, also those that are not metrics).
        self._keys: list[str] = []
        self._global: dict[int, list[np.ndarray]] = {}
        self.outputs: dict[int, dict[str, np.ndarray]] = {}

    def summary(self) -> None:
        """Flower's summary, after the round's name and its outputs."""
        p = self.parts
        log(INFO, "\t├──> fcir round @%s (%s)", p.module.name, p.plan.get("signature", ""))
        kept = ", ".join(p.output_names[o] for o in self.state.values())
        metrics = ", ".join(self._metric_names()) or "none"
        log(INFO, "\t│\t├──Global arrays from outputs: %s", kept)
        log(INFO, "\t│\t└──Metrics: %s", metrics)
        if self.evaluation is not None:
            log(INFO, "\t├──> fcir evaluation @%s: %s", self.evaluation.module.name,
                ", ".join(self.evaluation.output_names))
        super().summary()

    def _metric_names(self) -> list[str]:
        state = set(self.state.values())
        return [
            n for o, (n, s) in enumerate(zip(self.parts.output_names, self.parts.outputs))
            if o not in state and int(np.prod(s["shape"])) == 1
        ]

    # --- training -------------------------------------------------------------------

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        leaves = self._leaves(arrays)
        self._global[server_round] = leaves
        sent = record_of(self.parts.send(leaves))
        return super().configure_train(server_round, sent, config, grid)

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        valid, _ = self._check_and_log_replies(list(replies), is_train=True)
        leaves = self._global.pop(server_round, None)
        if not valid or leaves is None:
            return None, None
        need = self.parts.exchange.get("min_replies", 0)
        if len(valid) < need:
            # Fewer replies than the round's aggregates are defined for (Bulyan's 4f + 3):
            # skipped, as Flower's own Bulyan skips it; the global arrays stay.
            log(
                WARN,
                "Insufficient replies, skipping the round's aggregation: Required at least "
                "%d (%s), but received %d.",
                need, self.parts.exchange["min_replies_why"], len(valid),
            )  # fmt: skip
            return None, None
        # Weighted means are FedAvg's own average: computed as FedAvg computes it, over
        # the replies in the order FedAvg takes them, they are its bits.
        means = as_flower.fedavg_means(
            self.parts.exchange["aggregations"], [self._client_outputs(m) for m in valid]
        )
        outs = self.parts.finish(
            leaves, [self._client_outputs(m) for m in _in_node_order(valid)], aggregated=means
        )
        self.outputs[server_round] = dict(zip(self.parts.output_names, outs))
        new = list(leaves)
        for i, o in self.state.items():
            new[i] = outs[o]
        arrays = ArrayRecord({k: Array(np.asarray(x)) for k, x in zip(self._keys, new)})
        state = set(self.state.values())
        metrics = {
            name: _number(x)
            for o, (name, x) in enumerate(zip(self.parts.output_names, outs))
            if o not in state and np.asarray(x).size == 1
        }
        return arrays, MetricRecord(metrics)

    # --- evaluation -----------------------------------------------------------------

    def configure_evaluate(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        if self.evaluation is None:
            return super().configure_evaluate(server_round, arrays, config, grid)
        leaves = self._leaves(arrays)
        self._global[-server_round] = leaves
        sent = record_of(self.evaluation.send(leaves))
        messages = super().configure_evaluate(server_round, sent, config, grid)
        return messages

    def aggregate_evaluate(
        self, server_round: int, replies: Iterable[Message]
    ) -> MetricRecord | None:
        if self.evaluation is None:
            return super().aggregate_evaluate(server_round, replies)
        valid, _ = self._check_and_log_replies(list(replies), is_train=False)
        leaves = self._global.pop(-server_round, None)
        if not valid or leaves is None:
            return None
        outs = self.evaluation.finish(
            leaves, [self._client_outputs(m) for m in _in_node_order(valid)]
        )
        return MetricRecord(
            {n: _number(x) for n, x in zip(self.evaluation.output_names, outs)
             if np.asarray(x).size == 1}
        )

    # --- records ----------------------------------------------------------------------

    def _leaves(self, arrays: ArrayRecord) -> list[np.ndarray]:
        """The global arrays as the round's server inputs, in the record's order."""
        if not self._keys:
            self._keys = list(arrays.keys())
        return [runtime.from_array(a) for a in arrays.values()]

    def _client_outputs(self, reply: Message) -> dict:
        record = reply.content.array_records.get(self.arrayrecord_key)
        if record is None:
            record = next(iter(reply.content.array_records.values()))
        return from_reply(record, reply.content.config_records.get(LAYOUT))


def _in_node_order(replies: list[Message]) -> list[Message]:
    # Floating-point sums depend on their order: fcir's own aggregations (those FedAvg
    # has no counterpart for) add the replies in node order, not in the order they
    # happened to arrive.
    return sorted(replies, key=lambda m: m.metadata.src_node_id)


def _number(x) -> float | int:
    x = np.asarray(x).reshape(-1)[0]
    return int(x) if np.issubdtype(x.dtype, np.integer) else float(x)

