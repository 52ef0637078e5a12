"""An exported app run in this process: its ServerApp's ``main`` on a grid that hands
each message straight to the app's ClientApp function (no network, no processes).

It plays Flower's part honestly where the app can tell: every message to a node gets a
reply built by the client function (an exception becomes an error reply, as the
SuperNode makes it), and a node listed in ``silent`` never answers.
"""

from __future__ import annotations

import contextlib
import copy
import gc
import importlib.util
import itertools
import pathlib
import sys
import tempfile
import types

from flwr.app import Context, Error, Message, RecordDict

_COUNTER = itertools.count()


def load_app(appdir) -> types.SimpleNamespace:
    """The app's server_app and client_app modules, under a package name of their own."""
    pkg_dir = pathlib.Path(appdir) / "fcir_app"
    name = f"fcir_app_test_{next(_COUNTER)}"
    spec = importlib.util.spec_from_file_location(
        name, pkg_dir / "__init__.py", submodule_search_locations=[str(pkg_dir)]
    )
    pkg = importlib.util.module_from_spec(spec)
    sys.modules[name] = pkg
    spec.loader.exec_module(pkg)
    server = importlib.import_module(f"{name}.server_app")
    client = importlib.import_module(f"{name}.client_app")
    return types.SimpleNamespace(server=server, client=client)


class Grid:
    def __init__(self, app, node_configs: dict[int, dict], silent=(), lost=None):
        self.app = app
        self.contexts = {
            node: Context(
                run_id=1, node_id=node, node_config=cfg, state=RecordDict(), run_config={}
            )
            for node, cfg in node_configs.items()
        }
        self.silent = set(silent)
        self.lost = lost or {}  # node -> rounds whose reply is lost after the client ran
        self.sent: list[int] = []
        self.exchanged: list[tuple[Message, Message]] = []  # (message, reply) as delivered

    def get_node_ids(self):
        return list(self.contexts)

    def send_and_receive(self, messages, *, timeout=None):
        replies = []
        for msg in messages:
            node = msg.metadata.dst_node_id
            self.sent.append(node)
            if node in self.silent:
                continue
            # Each node gets its own copy, as off the network (SecAgg+ sends one content
            # object to every node, and secaggplus_mod pops keys from it).
            delivered = copy.deepcopy(msg)
            try:
                # dispatch by type, mods
                reply = self.app.client.app(delivered, self.contexts[node])
            except Exception as e:  # noqa: BLE001  (the SuperNode turns it into an error reply)
                reply = Message(Error(code=2, reason=f"{type(e)}:<'{e}'>"), reply_to=msg)
            assert reply.metadata.src_node_id == node  # a reply comes from its addressee
            self.exchanged.append((msg, reply))
            if node in self.lost and int(msg.content["config"]["server-round"]) in self.lost[node]:
                continue
            replies.append(reply)
        return replies


@contextlib.contextmanager
def own_garbage_only():
    """The objects this process holds before the block are left out of the collector's
    scans during it (``gc.freeze``; back after). Flower's array records call
    ``gc.collect()`` on every conversion that drops its input (QFedAvg and Bulyan per
    reply, a ClientApp's reply), and a full collection scans every object the process
    holds: late in a test session, millions (a QFedAvg run took 37 CPU s in CI, 3.5 in
    a fresh process). Cycles made in the block are still collected."""
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def run(
    appdir, node_configs: dict[int, dict], run_config: dict, silent=(), run_id: int = 1, lost=None
):
    """Runs the app's ServerApp main as run ``run_id``; returns the grid (what was sent
    to whom). ``lost``: node -> rounds in which its replies of plain exchanges never
    arrive (its ClientApp ran)."""
    from fcir.interpreters.flower.app_writer import RUN_CONFIG
    from flwr.supercore.task_identity import TaskIdentity

    # as flwr-serverapp
    TaskIdentity.run_id, TaskIdentity.task_id, TaskIdentity.node_id = run_id, 1, 0
    app = load_app(appdir)
    grid = Grid(app, node_configs, silent, lost)
    run_config = {**RUN_CONFIG, **run_config}
    context = Context(
        run_id=run_id, node_id=0, node_config={}, state=RecordDict(), run_config=run_config
    )
    for c in grid.contexts.values():  # a ClientApp sees the run's config too, as in Flower
        c.run_id, c.run_config = run_id, dict(context.run_config)
    grid.context = context  # the ServerApp's context (its state after the run)
    # In a directory of its own, as flwr-serverapp: the default output (final_model.npz)
    # is written to the working directory.
    with tempfile.TemporaryDirectory() as cwd, contextlib.chdir(cwd), own_garbage_only():
        app.server.main(grid, context)
        grid.cwd_files = sorted(p.name for p in pathlib.Path(cwd).iterdir())  # what it left there
        grid.final_model = _read(pathlib.Path(cwd) / "final_model.npz")
    return grid


def _read(path) -> list | None:
    """The arrays of an .npz in arr_i order, None when there is no such file."""
    import numpy as np

    if not path.exists():
        return None
    with np.load(path) as f:
        return [f[f"arr_{i}"] for i in range(len(f.files))]
