"""``fcir export --target flower`` (dispatched from the export command) and
``fcir flower up`` (a local SuperLink and SuperNodes to run exported apps on)."""

from __future__ import annotations

from fcir.errors import FcirError


def cmd_export_flower(module, a) -> int:
    from fcir.interpreters.production.cli import _read_npz

    from . import export

    inputs = _read_npz(a.inputs) if a.inputs else None
    if a.aggregate_with != "intrinsics":
        raise FcirError("--aggregate-with is for --target production; a Flower app aggregates itself")
    out = export(
        module, a.output, inputs=inputs, device_runtime=a.device_runtime,
        device_targets=a.device_target or (),
    )
    print(f"@{module.name}: wrote Flower app to {out}")
    print(f"run it: flwr run {out} FEDERATION --run-config 'rounds=1 output=\"/abs/out.npz\"'")
    return 0


def register(subparsers) -> None:
    """Adds ``fcir flower up``."""
    p = subparsers.add_parser(
        "flower",
        help="run exported Flower apps on a local SuperLink and SuperNodes",
        description="Tools for rounds exported with 'fcir export --target flower'.",
    )
    sub = p.add_subparsers(dest="flower_command", metavar="COMMAND")
    sub.required = True
    up = sub.add_parser(
        "up",
        help="start a SuperLink and N SuperNodes on localhost until Ctrl-C",
        description="Start one SuperLink and N SuperNodes on localhost, each its own "
        "process with a free port and its own FLWR_HOME under --dir. Node i reads its "
        "client data from DATA/node<i>.npz (or DATA/node<i>/{round}.npz when that folder "
        "exists, one file per exported round). Prints the 'flwr run' command line; "
        "Ctrl-C stops every process it started.",
        epilog="Example: fcir flower up --nodes 3 --data parts/  then, in another shell, "
        "the printed 'flwr run' line",
    )
    up.add_argument("--nodes", type=int, default=3, help="number of SuperNodes (default 3)")
    up.add_argument(
        "--data",
        metavar="DIR",
        help="folder with node0.npz, node1.npz, ... (or node0/, node1/, ... holding "
        "<round>.npz files)",
    )
    up.add_argument(
        "--dir",
        metavar="DIR",
        help="where the processes keep their homes and logs (default: a new temporary folder)",
    )
    up.set_defaults(func=cmd_up)


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


def cmd_up(a) -> int:
    import tempfile
    import time

    from .local import Deployment, env_for

    if a.nodes < 1:
        raise FcirError("fcir flower up: --nodes must be at least 1")
    root = a.dir or tempfile.mkdtemp(prefix="fcir-flower-")
    dep = Deployment(root, a.nodes, _data_paths(a.data, a.nodes))
    dep.start()
    try:
        home = env_for(dep.cli_home)["FLWR_HOME"]
        print(f"SuperLink on {dep.address}; {a.nodes} SuperNode(s) on ports "
              f"{', '.join(map(str, dep.node_ports))}; logs and homes in {dep.root}")
        print("Run an exported app (one progress line per round) with:")
        print(f"  FLWR_HOME={home} flwr run APPDIR local --stream "
              "--run-config 'rounds=1 output=\"/abs/out.npz\"'")
        print("Ctrl-C stops every process started here.", flush=True)
        while True:
            for name, proc in list(dep.procs.items()):
                if proc.poll() is not None:
                    raise FcirError(f"{name} exited ({proc.returncode}): {dep.log_tail(name)}")
            time.sleep(1)
    except KeyboardInterrupt:
        print("\nstopping ...", flush=True)
    finally:
        dep.stop()
    return 0
