"""An exported corpus round on Flower's Simulation Engine as a user runs it:
``fcir flower simulate APP --nodes N --data DIR`` in a fresh process, node ``i``
reading ``DIR/node<i>.npz``."""

from __future__ import annotations

import pathlib
import sys

import numpy as np

from . import rounds


def stage(name: str, appdir, data_dir) -> tuple[rounds.Round, pathlib.Path, pathlib.Path]:
    """Corpus round ``name`` exported to ``appdir``, its nodes' data in ``data_dir``."""
    r = rounds.corpus_round(name)
    app = rounds.export(r, appdir)
    plan = rounds.plan_of(app)
    data = pathlib.Path(data_dir)
    data.mkdir()
    for i in range(rounds.NODES):
        np.savez(data / f"node{i}.npz", *r.node_leaves(plan, i))
    return r, app, data


def command(app, data, run_config: str, root) -> list[str]:
    """The ``fcir flower simulate`` command line: ``rounds.NODES`` virtual nodes, its
    SuperLink's and Ray's files under ``root``."""
    return [
        sys.executable,
        "-m",
        "fcir.cli",
        "flower",
        "simulate",
        str(app),
        "--nodes",
        str(rounds.NODES),
        "--data",
        str(data),
        "--run-config",
        run_config,
        "--dir",
        str(root),
    ]
