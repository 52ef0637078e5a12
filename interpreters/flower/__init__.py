"""Export a round as a Flower app: ``fcir export --target flower ROUND -o APPDIR``.

::

    from fcir.interpreters import flower

    flower.export(module, "app/", inputs=server_leaves)   # ExportError if not exportable
    # then: flwr run app/ local --stream --run-config 'num-server-rounds=3'

The app's ServerApp runs the round's server parts (jax.export artifacts of the
production split), samples SuperNodes, aggregates their replies and checkpoints the
training state; each ClientApp runs client work from its artifact on the node's own
``.npz`` (node config ``data-path``). See docs/flower.md.
"""

from __future__ import annotations

import pathlib

from fcir.errors import ExportError
from fcir.ir import Module

from .app_writer import RUN_CONFIG, write_app

__all__ = ["RUN_CONFIG", "Client", "ExportError", "Strategy", "export"]


def __getattr__(name: str):
    # Strategy and Client subclass and use flwr, which exporting an app does not need.
    if name == "Strategy":
        from .strategy import Strategy

        return Strategy
    if name == "Client":
        from .client import Client

        return Client
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def export(
    module: Module, directory, *, inputs: list | None = None, device_runtime: str = "jax",
    device_targets=(),
    evaluation: Module | None = None,
) -> pathlib.Path:
    """Writes the Flower app of ``module`` (one round) to ``directory``.

    ``inputs``: the server's initial inputs (the server argument leaves, in leaf order),
    embedded in the app; without them ``flwr run`` needs run config ``inputs=FILE``.
    Raises ExportError naming the op when the round cannot run on Flower. Nothing is
    written unless the whole app is.

    ``device_runtime="iree"``: client work as IREE modules verified against XLA, one per
    ``device_targets`` entry (default the host's ``llvm-cpu``); nodes then need flwr,
    numpy and iree-base-runtime, not jax (docs/flower.md, "Devices without JAX").

    ``evaluation``: a captured ``fcir.evaluation(program)``; the app runs it in Flower's
    evaluate stage after each round (run config ``fraction-evaluate``, node config
    ``eval-data-path``) and logs its metrics by name.
    """
    return write_app(
        module, directory, inputs=inputs, device_runtime=device_runtime,
        device_targets=device_targets, evaluation=evaluation,
    )
