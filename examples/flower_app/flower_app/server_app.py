"""server_app.py: fcir's round as the strategy, alone and inside Flower's DP wrappers."""

import numpy as np
from fcir.interpreters import flower
from flwr.app import ArrayRecord, Context
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import (
    DifferentialPrivacyClientSideFixedClipping,
    DifferentialPrivacyServerSideFixedClipping,
)

from flower_app.task import capture, load_model

app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    cfg = context.run_config
    finals = {}
    for stage in cfg["stages"].split(","):  # each from the same initial model
        module, evaluation = capture()
        strategy = flower.Strategy(  # was: FedAvg(fraction_evaluate=...)
            module, evaluation=evaluation, fraction_evaluate=cfg["fraction-evaluate"]
        )
        arrays = ArrayRecord([np.asarray(v) for v in load_model((3,)).values()])
        result = wrapped(strategy, stage, cfg).start(
            grid=grid, initial_arrays=arrays, num_rounds=cfg["num-server-rounds"]
        )
        for k, a in zip(result.arrays.keys(), result.arrays.to_numpy_ndarrays()):
            finals[f"{stage}.{k}"] = a
    np.savez(cfg["output"], **finals)


def wrapped(strategy, stage: str, cfg):
    """``strategy`` inside the stage's DP wrapper of Flower's, if any."""
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
