"""``fcir export --target flower`` (a target this module adds to production's export
command) and ``fcir flower up`` (a local SuperLink and SuperNodes to run exported apps
on)."""

from __future__ import annotations

from fcir.interpreters.production import cli as production_cli

from fcir import argtable
from fcir.argtable import Command, option
from fcir.errors import FcirError
from fcir.frontend.capture import capture
from fcir.frontend.evaluation import evaluation
from fcir.frontend.loading import is_ir_file, load_inputs, load_module, load_python_target

from . import export
from .app import runtime as app_runtime
from .app import training
from .data import split_arguments
from .local import Deployment, _bin, env_for, flwr_run
from .simulation import simulate
from .app_writer import APP_PACKAGE


def cmd_export_flower(module, a) -> int:

    inputs = load_inputs(a.inputs) if a.inputs else None  # the server's inputs only
    if a.aggregate_with != "intrinsics":
        raise FcirError("--aggregate-with is for --target production; a Flower app aggregates itself")
    out = export(
        module, a.output, inputs=inputs, device_runtime=a.device_runtime,
        device_targets=a.device_target or (), evaluation=declared_evaluation(a.IN, a.args),
    )
    print(f"@{module.name}: wrote Flower app to {out}")
    print(f"run it: {run_hint(out)}")
    print(
        "(with the FLWR_HOME 'fcir flower up' prints, whose SuperLink connection is 'local'; "
        "the final outputs go to final_model.npz in the ServerApp's working directory, or "
        "to run config output=\"/abs/out.npz\")"
    )
    return 0


def declared_evaluation(target: str, arg_specs):
    """The evaluation a Python target's program declares (``fcir.program(evaluate=fn)``),
    captured on the round's own arguments of the same names (its data shapes are the
    training data's); None for an IR file or a program without one."""
    import inspect

    if is_ir_file(target):
        return None
    fn, args = load_python_target(target, arg_specs)
    evaluate = getattr(fn, "fcir_evaluate", None)
    if evaluate is None:
        return None

    def positional(f):
        return [p.name for p in inspect.signature(f).parameters.values()
                if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]

    names, wanted = positional(fn), positional(evaluate)
    missing = [n for n in wanted if n not in names]
    if missing:
        raise FcirError(
            f"export --target flower: the evaluation {evaluate.__name__}({', '.join(wanted)}) "
            f"takes {', '.join(missing)}, which {fn.__name__}({', '.join(names)}) does not: "
            "name the evaluation's arguments as the round's"
        )
    return capture(evaluation(fn), *[args[names.index(n)] for n in wanted])


def run_hint(appdir) -> str:
    """The ``flwr run`` line for ``appdir``: several rounds with the state mapping its
    pytree paths give, or one round when there is none (or when a DP key would be the
    same every round under it, which the ServerApp refuses)."""
    import json
    import pathlib

    plan = json.loads((pathlib.Path(appdir) / APP_PACKAGE / "plan.json").read_text())
    mapping = training.infer(plan)
    if "loop" in plan:  # the program's own loop runs the rounds
        config = ""
    elif mapping and training.fixed_key(plan, mapping) is None:
        config = f' --run-config \'num-server-rounds=3 state="{training.text(mapping)}"\''
    else:
        config = " --run-config 'num-server-rounds=1'"
    # flwr 1.42: flwr run [APP] [SUPERLINK]: `local` is the SuperLink connection that
    # `fcir flower up` writes in its FLWR_HOME's config.toml.
    return f"flwr run {appdir} local --stream{config}"


def register(subparsers) -> None:
    """Adds ``fcir flower up`` (and its siblings) and ``fcir export --target flower``."""
    production_cli.add_export_target("flower", cmd_export_flower)
    argtable.add(subparsers, FLOWER)


def _data_paths(data, nodes: int) -> list:
    import pathlib

    if data is None:
        return [None] * nodes
    root = pathlib.Path(data).resolve()
    if not root.is_dir():
        raise FcirError(f"fcir flower up: --data {data} is not a folder")
    paths = []
    for i in range(nodes):
        if (root / f"node{i}").is_dir():
            paths.append(root / f"node{i}" / "{round}.npz")
        elif (root / f"node{i}.npz").is_file():
            paths.append(root / f"node{i}.npz")
        else:
            raise FcirError(
                f"fcir flower up: no data for node {i}: put node{i}.npz (or a node{i}/ "
                f"folder of <round>.npz files) in {root}"
            )
    return paths


class _Stop(Exception):  # noqa: N818  (a signal, not an error)
    """SIGTERM or SIGHUP reached ``fcir flower up``: stop as on Ctrl-C."""


def cmd_up(a) -> int:
    import signal
    import tempfile
    import time

    if a.nodes < 1:
        raise FcirError("fcir flower up: --nodes must be at least 1")
    root = a.dir or tempfile.mkdtemp(prefix="fcir-flower-")
    dep = Deployment(root, a.nodes, _data_paths(a.data, a.nodes), tls=a.tls)

    def stop(signum, frame):
        raise _Stop(signum)

    # `kill PID` (SIGTERM) and a closed terminal (SIGHUP) stop what was started here as
    # Ctrl-C does: the processes run in sessions of their own, so nothing else would.
    previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGTERM, signal.SIGHUP)}
    try:
        dep.start()
        home = env_for(dep.cli_home)["FLWR_HOME"]
        print(f"SuperLink on {dep.address}; {a.nodes} SuperNode(s) on ports "
              f"{', '.join(map(str, dep.node_ports))}; logs and homes in {dep.root}")
        if a.tls:
            print(f"TLS: CA {dep.certificates.ca} (config.toml's root-certificates; a "
                  "SuperNode elsewhere passes it as --root-certificates)")
        print("Run an exported app (one progress line per round) with:")
        print(f"  FLWR_HOME={home} fcir flower run APPDIR "
              "--run-config 'num-server-rounds=1 output=\"/abs/out.npz\"'")
        print(f"  (or FLWR_HOME={home} flwr run APPDIR local --stream ..., which exits 0 "
              "even when the ServerApp fails: see flwr ls local)")
        print("Ctrl-C (or SIGTERM, SIGHUP) stops every process started here.", flush=True)
        while True:
            for name, proc in list(dep.procs.items()):
                if proc.poll() is not None:
                    raise FcirError(f"{name} exited ({proc.returncode}): {dep.log_tail(name)}")
            time.sleep(1)
    except (KeyboardInterrupt, _Stop):
        print("\nstopping ...", flush=True)
    finally:
        for sig in previous:  # a second signal must not cut the stop short
            signal.signal(sig, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        try:
            dep.stop()
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            signal.signal(signal.SIGINT, signal.default_int_handler)
    return 0


def refuse_renamed_keys(run_config: str) -> None:
    """An old run config name in ``--run-config`` (``rounds=3``) is refused naming
    Flower's, before flwr run refuses it as a key pyproject.toml does not declare."""
    import re

    keys = re.findall(r"(?:^|\s)([A-Za-z][\w-]*)\s*=", run_config or "")
    old = app_runtime.renamed(keys)
    if old:
        raise FcirError("; ".join(old) + ": rename it in --run-config")


def cmd_run(a) -> int:
    """``flwr run APPDIR SUPERLINK --stream``, then the run's status from the SuperLink:
    exit 1 with the ServerApp's error when it failed."""
    import os
    import sys

    if not os.environ.get("FLWR_HOME"):
        raise FcirError(
            "fcir flower run: set FLWR_HOME to the home that names the SuperLink (the line "
            "'fcir flower up' prints)"
        )
    env = env_for(os.environ["FLWR_HOME"])
    refuse_renamed_keys(a.run_config)
    cmd = [_bin("flwr"), "run", str(a.app), a.superlink, "--stream"]
    if a.run_config:
        cmd += ["--run-config", a.run_config]
    result = flwr_run(cmd, env, a.superlink, echo=sys.stdout)
    if not result.ok:
        raise FcirError(f"run {result.run_id} failed: {result.failure()}")
    print(f"[fcir] run {result.run_id} {result.said}", flush=True)
    return 0


def cmd_simulate(a) -> int:
    import signal
    import sys

    if a.actors is not None and a.actors < 1:
        raise FcirError("fcir flower simulate: --actors must be at least 1")
    refuse_renamed_keys(a.run_config)

    def stop(signum, frame):
        raise _Stop(signum)

    # SIGTERM / SIGHUP stop the simulation's SuperLink (its own session) as Ctrl-C does.
    previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGTERM, signal.SIGHUP)}
    try:
        result = simulate(
            a.app, a.nodes, a.data, a.run_config, actors=a.actors, root=a.dir, echo=sys.stdout
        )
    except _Stop as e:
        raise FcirError(f"stopped by signal {e.args[0]}; everything it started is stopped") from None
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if not result.ok:
        raise FcirError(f"simulated run {result.run_id} failed: {result.failure()}")
    print(f"[fcir] simulated run {result.run_id} {result.said}", flush=True)
    return 0


def cmd_data(a) -> int:
    import jax

    if is_ir_file(a.IN):
        if not a.inputs:
            raise FcirError("an IR file carries no argument values: give them with --inputs ARGS.npz")
        module = load_module(a.IN)
        args = load_inputs(a.inputs, module)
    else:

        fn, args = load_python_target(a.IN)
        if a.inputs:  # the values of the file's arguments, in EXAMPLE_ARGS' structure
            leaves, treedef = load_inputs(a.inputs), jax.tree.structure(args)
            if len(leaves) != treedef.num_leaves:
                raise FcirError(
                    f"--inputs holds {len(leaves)} array(s); {a.IN} takes "
                    f"{treedef.num_leaves} argument leaves"
                )
            args = jax.tree.unflatten(treedef, leaves)
        module = capture(fn, *args, name=a.IN.rpartition(":")[2])
    server, nodes = split_arguments(module, args, a.output)
    where = f" and node0.npz..node{len(nodes) - 1}.npz" if nodes else ""
    print(f"@{module.name}: wrote {server.name}{where} in {server.parent}")
    return 0


def cmd_plot(a) -> int:
    import json
    import pathlib

    try:
        history = json.loads(pathlib.Path(a.metrics).read_text())
        rounds = history.pop("round")
    except (OSError, ValueError, KeyError, AttributeError) as e:
        raise FcirError(f"{a.metrics} is not a metrics file (run config metrics-file): {e}") from None
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise FcirError("fcir flower plot needs matplotlib: pip install matplotlib") from None
    names = sorted(history)
    if not names:
        raise FcirError(f"{a.metrics} holds no metrics")
    fig, axes = plt.subplots(len(names), 1, figsize=(5, 2.2 * len(names)), squeeze=False)
    for ax, name in zip(axes[:, 0], names):
        ax.plot(rounds, history[name], marker="o")
        ax.set_ylabel(name)
        ax.grid(alpha=0.3)
    axes[-1, 0].set_xlabel("round")
    fig.tight_layout()
    fig.savefig(a.output, dpi=100)
    print(f"wrote {a.output}: {', '.join(names)} over {len(rounds)} round(s)")
    return 0


# --- the command line -------------------------------------------------------------------

_APP = option("app", metavar="APP", help="the exported app directory")
_RUN_CONFIG = option("--run-config", default="", metavar="'K=V ...'", help="run config overrides")

UP = Command(
    "up",
    help="start a SuperLink and N SuperNodes on localhost until Ctrl-C",
    description="Start one SuperLink and N SuperNodes on localhost, each its own "
    "process with a free port and its own FLWR_HOME under --dir. Node i reads its "
    "client data from DATA/node<i>.npz (or DATA/node<i>/{round}.npz when that folder "
    "exists, one file per exported round). Prints the 'flwr run' command line; "
    "Ctrl-C stops every process it started.",
    epilog="Example: fcir flower up --nodes 3 --data parts/  then, in another shell, "
    "the printed 'flwr run' line",
    options=(
        option("--nodes", type=int, default=3, help="number of SuperNodes (default 3)"),
        option(
            "--data",
            metavar="DIR",
            help="folder with node0.npz, node1.npz, ... (or node0/, node1/, ... holding "
            "<round>.npz files)",
        ),
        option(
            "--dir",
            metavar="DIR",
            help="where the processes keep their homes and logs (default: a new temporary folder)",
        ),
        option(
            "--tls",
            action="store_true",
            help="TLS instead of --insecure: makes a localhost CA and a SuperLink certificate "
            "under --dir/certificates and starts every process with them",
        ),
    ),
    func=cmd_up,
)
RUN = Command(
    "run",
    help="flwr run an exported app and exit non-zero when its ServerApp fails",
    description="Run an exported app with 'flwr run APP SUPERLINK --stream' (FLWR_HOME "
    "names the SuperLink, as 'fcir flower up' prints it), stream its log, then ask the "
    "SuperLink how the run ended: exit 0 when it completed, 1 with the ServerApp's "
    "error when it failed (flwr run itself exits 0 either way).",
    epilog="Example: FLWR_HOME=/tmp/fcir-flower-x/home-cli fcir flower run app/ "
    "--run-config 'num-server-rounds=3 output=\"/abs/out.npz\"'",
    options=(
        _APP,
        option(
            "--superlink",
            "--federation",  # its name before flwr 1.42 called the argument a SuperLink connection
            dest="superlink",
            default="local",
            help="the SuperLink connection in FLWR_HOME's config.toml (default: local)",
        ),
        _RUN_CONFIG,
    ),
    func=cmd_run,
)
SIMULATE = Command(
    "simulate",
    help="run a Flower app (exported or your own) on Flower's Simulation Engine (Ray)",
    description="Run a Flower app on Flower's Simulation Engine: a SuperLink in "
    "simulation mode on a free port runs the ServerApp, in the folder the command was "
    "started in (relative paths it writes land there), and N virtual SuperNodes run the "
    "ClientApp in Ray actors. Node i reads DATA/node<i>.npz (or "
    "DATA/node<i>/<round>.npz), as with 'fcir flower up --data'; the outputs are bit "
    "for bit those of the same run on a deployment. Exits 1 with the ServerApp's "
    "error when it fails, and stops every process it started.",
    epilog="Example: fcir flower simulate app/ --nodes 3 --data parts/ --run-config "
    "'num-server-rounds=3 output=\"out.npz\"'",
    options=(
        option("app", metavar="APP", help="the app directory (with its pyproject.toml)"),
        option("--nodes", type=int, required=True, help="number of virtual SuperNodes"),
        option("--data", metavar="DIR", help="folder with node0.npz, node1.npz, ..."),
        _RUN_CONFIG,
        option(
            "--actors",
            type=int,
            default=None,
            help="ClientApps run at once (Ray CPUs; each ClientApp takes one; default: "
            "min(2, CPU count))",
        ),
        option(
            "--dir",
            metavar="DIR",
            help="where the SuperLink keeps its home and log, kept after the run (default: "
            "a temporary folder, removed when the run ends)",
        ),
    ),
    func=cmd_simulate,
)
DATA = Command(
    "data",
    help="split a round's arguments into the server inputs file and one file per node",
    description="Write DIR/server_inputs.npz (the server argument leaves, in leaf order: "
    "what 'fcir export --target flower --inputs' and run config inputs= read) and "
    "DIR/node<i>.npz for each of the round's clients (client i's slice of every client "
    "argument leaf: what 'fcir flower up/simulate --data DIR' gives node i).",
    epilog="Example: fcir flower data examples/fedavg.py:fedavg_round -o parts/  "
    "(a Python target's EXAMPLE_ARGS), or fcir flower data round.fcir --inputs args.npz "
    "-o parts/ (every argument leaf, as fcir run takes them)",
    options=(
        option("IN", help="the round: file.py:function (with EXAMPLE_ARGS) or an IR file"),
        option("-o", "--output", required=True, metavar="DIR", help="folder to write"),
        option(
            "--inputs",
            metavar="ARGS.npz",
            help="every argument leaf (arr_0, arr_1, ...), for an IR file or instead of "
            "EXAMPLE_ARGS",
        ),
    ),
    func=cmd_data,
)
PLOT = Command(
    "plot",
    help="plot the per-round metrics a run wrote (run config metrics-file)",
    description="Draw each metric of a metrics file (written by an exported app with "
    "--run-config 'metrics-file=\"/abs/metrics.json\"') against the round, one panel "
    "per metric, into a PNG. Needs matplotlib.",
    epilog="Example: fcir flower plot metrics.json -o loss.png",
    options=(
        option(
            "metrics",
            metavar="METRICS.json",
            help="the metrics file a run wrote (run config metrics-file)",
        ),
        option("-o", "--output", required=True, metavar="PNG", help="where to write the picture"),
    ),
    func=cmd_plot,
)
FLOWER = Command(
    "flower",
    help="run exported Flower apps: a local deployment, the Simulation Engine, node data",
    description="Tools for rounds exported with 'fcir export --target flower'.",
    commands=(UP, RUN, SIMULATE, DATA, PLOT),
    dest="flower_command",
)
