"""server_app.py: fcir's round as the strategy, alone and inside Flower's DP wrappers."""

import numpy as np
from fcir.interpreters import flower
from flwr.app import ArrayRecord, Context, MetricRecord
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import (
    DifferentialPrivacyClientSideFixedClipping,
    DifferentialPrivacyServerSideFixedClipping,
)

from userapp.task import capture, load_model

app = ServerApp()


def global_evaluate(server_round: int, arrays: ArrayRecord) -> MetricRecord:
    b, w = arrays.to_numpy_ndarrays()
    return MetricRecord({"w-norm": float(np.linalg.norm(w))})


def make_strategy(stage: str, cfg):
    module, evaluation = capture()
    strategy = flower.Strategy(module, evaluation=evaluation,
                               fraction_evaluate=cfg["fraction-evaluate"])
    if stage == "server-dp":
        strategy = DifferentialPrivacyServerSideFixedClipping(
            strategy,
            noise_multiplier=cfg["noise-multiplier"],
            clipping_norm=cfg["clipping-norm"],
            num_sampled_clients=3,
        )
    if stage == "client-dp":  # the ClientApp: client_app:dp_app, with fixedclipping_mod
        strategy = DifferentialPrivacyClientSideFixedClipping(
            strategy,
            noise_multiplier=cfg["noise-multiplier"],
            clipping_norm=cfg["clipping-norm"],
            num_sampled_clients=3,
        )
    return strategy


@app.main()
def main(grid: Grid, context: Context) -> None:
    cfg = context.run_config
    finals = {}
    for stage in cfg["stages"].split(","):  # each from the same initial model
        arrays = ArrayRecord([np.asarray(v) for v in load_model().values()])
        result = make_strategy(stage, cfg).start(
            grid=grid,
            initial_arrays=arrays,
            num_rounds=cfg["num-server-rounds"],
            evaluate_fn=global_evaluate,
        )
        keys = [f"{stage}.{k}" for k in result.arrays.keys()]
        finals.update(zip(keys, result.arrays.to_numpy_ndarrays()))
    np.savez(cfg["output"], **finals)
