"""An exchange whose secure sums go through Flower's SecAgg+ protocol.

``SecAggPlusWorkflow`` (flwr 1.42) drives four stages (keys, key shares, masked
vectors, unmasking) over the legacy Strategy/FitIns/FitRes plumbing: it asks its
strategy for (node, FitIns) pairs, sends each node its FitIns in the masked-vectors
stage (the ClientApp's ``secure`` handler, under ``secaggplus_mod``), sums the masked
FitRes parameters, removes the masks, and hands the strategy's ``aggregate_fit`` the
FitRes of the clients whose masked vectors came in, each carrying the unmasked mean.

So one exchange carries everything: the broadcast values go out in the FitIns config,
the secure sums' inputs come back as masked 16-bit chunks in the FitRes parameters (see
runtime.to_chunks: exact integer sums), and the outputs the other aggregations need come
back in the clear in the FitRes metrics, as in a plain exchange. The survivors are the
clients whose masked vectors reached the server; every aggregation of the exchange,
secure or not, is over them.
"""

from __future__ import annotations

import types

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Context, RecordDict
from flwr.common import FitIns, Parameters, parameters_to_ndarrays
from flwr.server.client_manager import SimpleClientManager
from flwr.server.compat.legacy_context import LegacyContext
from flwr.server.workflow import SecAggPlusWorkflow
from flwr.server.workflow.constant import MAIN_CONFIGS_RECORD, MAIN_PARAMS_RECORD, Key

from . import runtime
from .runtime import AppError

# Each client's private key is shared with all sampled clients, and half of them
# (at least 2) recover it: one client in three may drop out after the key stages.
SHARES = 1.0
THRESHOLD = 0.5
# Below 3 sampled clients SecAgg+ hides nothing (each of 2 clients learns the other's
# value from the sum) and tolerates no dropout (its threshold is at least 2).
MIN_CLIENTS = 3
# The per-chunk sums of k clients must stay below the masks' modulus 2**32.
MAX_CLIENTS = runtime.SECAGG_MODULUS // runtime.SECAGG_QUANTIZATION - 1


class _Strategy:
    """The two calls SecAggPlusWorkflow makes on its legacy Strategy."""

    def __init__(self, nodes: list[int], fitins: FitIns):
        self.nodes, self.fitins = nodes, fitins
        self.results = self.failures = None

    def configure_fit(self, server_round, parameters, client_manager):
        return [(types.SimpleNamespace(node_id=n), self.fitins) for n in self.nodes]

    def aggregate_fit(self, server_round, results, failures):
        self.results, self.failures = results, failures
        return None, {}  # nothing for the workflow to store: we read self.results


class _Recorder:
    """The grid, noting which nodes answered the key stages (the protocol's first two
    exchanges) without error, and every error reply."""

    def __init__(self, grid, errors: list[str]):
        self.grid, self.answered, self.errors, self.calls = grid, None, errors, 0

    def send_and_receive(self, messages, *, timeout=None):
        replies = self.grid.send_and_receive(messages, timeout=timeout)
        ok = {r.metadata.src_node_id for r in replies if not r.has_error()}
        self.calls += 1
        if self.calls <= 2:
            self.answered = ok if self.answered is None else self.answered & ok
        self.errors += [f"node {r.metadata.src_node_id}: {r.error.reason}" for r in replies if r.has_error()]
        return replies

    def __getattr__(self, name):
        return getattr(self.grid, name)


def _check_count(nodes: list[int], rnd: int) -> None:
    if not MIN_CLIENTS <= len(nodes) <= MAX_CLIENTS:
        raise AppError(
            f"round {rnd}: a secure sum on SecAgg+ needs {MIN_CLIENTS}..{MAX_CLIENTS} sampled "
            f"clients, got {len(nodes)}: sample more (min-train-nodes={MIN_CLIENTS}) or run "
            "with --run-config 'secagg=false' (secure sums summed by the ServerApp)"
        )


def _run_workflow(grid, nodes: list[int], fitins: FitIns, rnd: int, timeout: float) -> _Strategy:
    strategy = _Strategy(nodes, fitins)
    state = RecordDict(
        {MAIN_CONFIGS_RECORD: ConfigRecord({Key.CURRENT_ROUND: rnd}), MAIN_PARAMS_RECORD: ArrayRecord()}
    )
    context = LegacyContext(
        Context(run_id=0, node_id=0, node_config={}, state=state, run_config={}),
        strategy=strategy,
        client_manager=SimpleClientManager(),
    )
    workflow = SecAggPlusWorkflow(
        SHARES,
        THRESHOLD,
        max_weight=1.0,  # num_examples=1: every client's weight is 1, its chunks unscaled
        clipping_range=runtime.SECAGG_CLIPPING,
        quantization_range=runtime.SECAGG_QUANTIZATION,
        modulus_range=runtime.SECAGG_MODULUS,
        timeout=timeout,
    )
    workflow(grid, context)
    return strategy


def exchange(
    grid, nodes: list[int], step_index: int, step: dict, values: dict, rnd: int, timeout: float,
    extra=None,
):
    """Runs the exchange through SecAgg+ on ``nodes``. Returns (replies, errors,
    secure, received): replies as ((partition, node), plain client outputs by name),
    the error texts of the clients left out, the secure sums' results by output name,
    and the bytes received (plain outputs and the chunks masked). ``extra``: more
    entries of the FitIns config (a program's per-client state, server_app.py)."""
    _check_count(nodes, rnd)
    fitins = FitIns(
        Parameters(tensors=[], tensor_type=""),
        {"step": step_index, "round": rnd, **(extra or {}), **runtime.pack(values, "v:")},
    )
    dropped: list[str] = []  # the clients left out before a restart, and why
    while True:
        errors: list[str] = []
        recorder = _Recorder(grid, errors)
        strategy = _run_workflow(recorder, nodes, fitins, rnd, timeout)
        if strategy.results is not None:
            errors = dropped + errors
            break
        # Flower 1.42 unmasks a client that left after sharing its keys, but halts when
        # one leaves before (no shares of its key exist, yet it tries to recover it):
        # start again with the clients that answered both key stages, while enough remain.
        left = sorted(set(nodes) - (recorder.answered or set()))
        if not left or len(nodes) - len(left) < MIN_CLIENTS:
            raise AppError(
                f"round {rnd}: SecAgg+ halted: too few of the {len(nodes)} sampled clients "
                f"took part in its stages to unmask the sum (it needs {MIN_CLIENTS})"
                f"{': ' if dropped + errors else ''}{'; '.join(dropped + errors)}"
            )
        for n in left:
            why = [e for e in errors if e.startswith(f"node {n}: ")]
            dropped.append(why[0] if why else f"node {n}: did not answer SecAgg+'s key stages in {timeout:g} s")
        print(
            f"[fcir] round {rnd}: SecAgg+ starts again without node(s) "
            f"{', '.join(map(str, left))}, which left before their keys were shared",
            flush=True,
        )
        nodes = [n for n in nodes if n not in left]
    sums = runtime.secure_inputs(step)
    k = len(strategy.results)
    if k == 0:
        raise AppError(f"round {rnd}: no client's masked vector reached the server: {'; '.join(errors)}")
    replies, received, means = [], 0, None
    for proxy, res in strategy.results:
        plain = {key.partition("/")[2]: x for key, x in runtime.unpack(res.metrics, "v:").items()}
        received += sum(np.asarray(x).nbytes for x in plain.values())
        order = (int(res.metrics["partition"]), proxy.node_id)
        replies.append((order, plain))
        means = parameters_to_ndarrays(res.parameters)  # the same unmasked vector in each
        dtypes = [str(res.metrics[f"dtype:{name}"]) for name, _ in sums]
    secure = {}
    for (_, bw), mean, dtype, agg in zip(sums, means, dtypes, _secure_aggs(step)):
        received += k * mean.size * 8
        secure[agg["output"]] = runtime.from_chunk_sums(runtime.chunk_sums(mean, k), bw, runtime.np_dtype(dtype))
    return replies, errors, secure, received


def _secure_aggs(step: dict) -> list[dict]:
    return [a for a in step["aggregations"] if runtime.is_secure_sum(a)]
