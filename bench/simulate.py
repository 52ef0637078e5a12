"""Population-scale FedAvg, the same experiment in every system, side by side in one run.

    python bench/simulate.py [--json PATH]        # full: the sizes below, 5 repetitions
    python bench/simulate.py --smoke              # tiny sizes, one repetition (CI)

The experiment (pfl-research's CIFAR-10 benchmark, bench/cifar.py): CIFAR-10 shapes
(32x32x3 inputs, 10 classes), its small CNN (bench/flower_cifar/hand_cifar/cnn.py in
JAX; pfl's own PyTorch model), synthetic data of those shapes (no download); a
population of 1,000 clients of 50 examples; each round samples a cohort of 50 uniformly
without replacement; one local epoch of SGD in batches of 10 (5 steps, learning rate
0.1); the server adds the mean delta. 20 rounds per sample, after a warm-up.

Systems (each skipped, with the reason, when not installed):

- ``fcir``: the population API: ``fcir.Population`` of the clients' data, uniform
  cohorts, ``xla.simulate`` of the round compiled by ``xla.compile(..., members=M)``
  (``--members``, default ``auto``: on CPU the members one after another with
  XLA:CPU's fast convolutions, ``fcir.interpreters.xla.members``), in the loop
  ``xla.simulate`` picks (``--loop``, default ``auto``: this population of 614 MB
  fits a quarter of a TPU's memory, so the device loop, every round in one program
  gathering its cohort on the device; else the host loop, which gathers the next
  cohort and puts it on the device while the round runs); ``fcir k=K`` the same
  compiled with ``clients_per_step=K`` (``--clients-per-step auto``: the k
  ``xla.compile`` picks for the device's memory); only when named in ``--systems``:
  ``fcir vmap`` with ``members="vmap"``, the lowering ``jax.jit`` gives, and ``fcir
  host`` in the host loop;
- ``drjax``: the same round on DrJAX 0.2.1 (``jax.jit``) and a hand-written sampling
  loop (bench/cifar.py ``HandLoop``: sample, gather on the host, ``device_put`` the
  next cohort while the round runs);
- ``pfl``: pfl 0.6, PyTorch, set up as its CIFAR-10 benchmark (bench/simulate_pfl.py,
  a worker process in ``.venv-pfl``: pfl pins dp-accounting 0.5, fcir needs 0.6);
- ``hand-flower``: bench/flower_cifar, FedAvg written by hand against Flower's Message
  API, on Flower's Simulation Engine with one virtual SuperNode per client;
- ``fcir-flower``: ``fcir flower simulate`` of ``flower.export`` of the fcir round
  (run config ``clients=50``), the same nodes and node files.

Each repetition runs every system once, rotating which goes first: ``ROUNDS`` rounds
for the in-process and pfl systems (warmed up once beforehand), one simulation run
of ``1 + ROUNDS`` rounds for the Flower systems (the first round, which starts Ray's
workers and compiles, is not counted: their time is the sum of the rounds' times their
ServerApps print). Reported: rounds per second per system (median, min, max) and per
repetition the ratios fcir/pfl, fcir/drjax and fcir-flower/hand-flower (median, min,
max); versions of every system; the load average before and after. A system that runs
out of the device's memory, compiling or running, is recorded as such (table and JSON,
``out_of_memory``) and the others go on. ``--json PATH``
writes the median ratios under those keys; the full record goes to
bench/results/simulate[-smoke]-<time>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
BENCH = ROOT / "bench"
sys.path.insert(0, str(BENCH))

import _record  # noqa: E402  (bench/, the script's own folder)
import _timing  # noqa: E402
import cifar  # noqa: E402

FULL = {"clients": 1000, "examples": 50, "cohort": 50, "batch": 10, "rounds": 20, "reps": 5,
        "clients_per_step": 10}  # fmt: skip
SMOKE = {"clients": 12, "examples": 20, "cohort": 4, "batch": 10, "rounds": 2, "reps": 1,
         "clients_per_step": 2}  # fmt: skip
SYSTEMS = ("fcir", "fcir-k", "drjax", "pfl", "hand-flower", "fcir-flower")
EXTRA = ("fcir-vmap", "fcir-host")  # run only when --systems names them
RATIOS = (("fcir", "pfl"), ("fcir", "drjax"), ("fcir-flower", "hand-flower"),
          ("fcir-k", "pfl"), ("fcir-k", "drjax"), ("fcir", "fcir-vmap"),
          ("fcir-vmap", "pfl"), ("fcir-host", "drjax"))  # fmt: skip
GOALS = {"fcir/pfl": 5.0, "fcir/drjax": 1.0, "fcir-flower/hand-flower": 1.0}
PROTOCOL = "FCIR-BENCH"


class Skipped(Exception):
    """A system that cannot run here; the message says why."""


# --- the systems: each .sample() returns the seconds of cfg["rounds"] rounds -------------


class InProcess:
    """DrJAX: the compiled round and the hand sampling loop, in this process."""

    def __init__(self, cfg: dict, pop):
        c, n, b = cfg["cohort"], cfg["examples"], cfg["batch"]
        try:
            import drjax  # noqa: F401
        except ImportError as e:
            raise Skipped(f"drjax not installed ({e})") from None
        self.loop = cifar.HandLoop(cifar.compile_drjax(c, n, b), *pop, c, b)
        self.loop.run(1)  # warm-up
        self.rounds = cfg["rounds"]

    def sample(self) -> float:
        t = time.perf_counter()
        self.losses = self.loop.run(self.rounds)
        return time.perf_counter() - t

    def close(self):
        pass


class Simulated:
    """fcir: ``xla.simulate`` (host loop) of the compiled round over the population's
    uniform cohorts, each sample continuing from the rounds before it."""

    def __init__(self, name: str, cfg: dict, pop, members: str, loop: str):
        import jax
        from fcir.interpreters import xla

        self.xla, self.jax = xla, jax
        self.cohorts = cifar.population_fcir(pop, cfg["batch"], cfg["cohort"])
        k = cfg["clients_per_step"] if name == "fcir-k" else None
        self.exe = cifar.compile_population(
            self.cohorts, "vmap" if name == "fcir-vmap" else members, k
        )
        self.streaming = self.exe.streaming  # with "auto": the k chosen, the candidates
        self.loop = "host" if name == "fcir-host" else loop
        self.params = cifar.model().init_params(0, pop[0].shape[2:])
        self.round = 0
        self.rounds = cfg["rounds"]
        # Warm-up: as many rounds as a sample, since the device loop compiles its scan
        # for that many (on a TPU a first sample of 20 after a warm-up of 1 took 5.7 s).
        self._run(self.rounds)

    def _run(self, rounds: int) -> None:
        self.params, losses = self.xla.simulate(
            self.exe, self.params, self.cohorts, rounds, first_round=self.round, loop=self.loop
        )
        self.jax.block_until_ready((self.params, losses))
        self.losses = [float(v) for v in losses]
        self.round += rounds

    def sample(self) -> float:
        t = time.perf_counter()
        self._run(self.rounds)
        return time.perf_counter() - t

    def close(self):
        pass


class PflWorker:
    """pfl in its own virtualenv's Python (bench/simulate_pfl.py), kept running."""

    def __init__(self, cfg: dict, python: str, threads: int | None = None):
        if not pathlib.Path(python).exists():
            raise Skipped(f"no {python}: install pfl there (docs: bench/README.md)")
        args = [str(cfg[k]) for k in ("clients", "examples", "cohort", "batch")]
        args += [] if threads is None else [str(threads)]
        self.proc = subprocess.Popen(
            [python, str(BENCH / "simulate_pfl.py"), *args], stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=BENCH,
        )  # fmt: skip
        hello = self._reply()
        self.versions = hello["versions"]
        self.rounds = cfg["rounds"]
        self._ask(1)  # warm-up

    def _reply(self) -> dict:
        for line in self.proc.stdout:
            if line.startswith(PROTOCOL):
                return json.loads(line[len(PROTOCOL) :])
        err = self.proc.stderr.read()[-2000:]
        raise Skipped(f"pfl worker exited: {err.strip().splitlines()[-1] if err else '?'}")

    def _ask(self, rounds: int) -> float:
        self.proc.stdin.write(f"run {rounds}\n")
        self.proc.stdin.flush()
        return self._reply()["seconds"]

    def sample(self) -> float:
        return self._ask(self.rounds)

    def close(self):
        if self.proc.poll() is None:
            self.proc.stdin.write("quit\n")
            self.proc.stdin.flush()
            self.proc.wait(timeout=60)


class FlowerRun:
    """One ``fcir flower simulate`` run per sample: ``1 + rounds`` rounds on one virtual
    SuperNode per client; the sample is the sum of the printed times of the rounds
    after the first."""

    LINE = {"hand-flower": re.compile(r"\[hand\] round (\d+)/\d+: .*? (\d+\.\d+) s"),
            "fcir-flower": re.compile(r"\[fcir\] round (\d+)/\d+: .*? (\d+\.\d+) s")}  # fmt: skip

    def __init__(self, name: str, cfg: dict, work: pathlib.Path, staged: dict):
        try:
            import flwr  # noqa: F401
        except ImportError as e:
            raise Skipped(f"flwr not installed ({e})") from None
        self.name, self.cfg, self.work = name, cfg, work
        self.app, self.data = staged["app"][name], staged["data"]
        self.runs = 0

    def sample(self) -> float:
        rounds = 1 + self.cfg["rounds"]
        config = f"num-server-rounds={rounds} clients={self.cfg['cohort']}"
        self.runs += 1
        cmd = [sys.executable, "-m", "fcir.cli", "flower", "simulate", str(self.app),
               "--nodes", str(self.cfg["clients"]), "--data", str(self.data),
               "--run-config", config, "--dir", str(self.work / f"{self.name}-{self.runs}")]  # fmt: skip
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=3600, check=False,
                              cwd=self.work)  # the final model lands there, not in the caller's folder
        out = proc.stdout + proc.stderr
        times = {int(r): float(s) for r, s in self.LINE[self.name].findall(out)}
        if proc.returncode != 0 or len(times) != rounds:
            raise RuntimeError(f"{self.name}: fcir flower simulate failed:\n{out[-3000:]}")
        return sum(times[r] for r in range(2, rounds + 1))

    def close(self):
        pass


def stage_flower(cfg: dict, pop, work: pathlib.Path) -> dict:
    """The node files (``node<i>.npz``: the client's batches, then labels) and both apps:
    the hand-written one (bench/flower_cifar) and fcir's export of the round."""
    import numpy as np
    from fcir.interpreters import flower

    import fcir

    c, n, b = cfg["cohort"], cfg["examples"], cfg["batch"]
    module = fcir.capture(cifar.fedavg(c, fcir), *cifar.specs(c, n, b))
    params = cifar.model().init_params(0)
    app = flower.export(module, work / "fcir_app", inputs=list(params[k] for k in sorted(params)))
    plan = json.loads((app / "fcir_app" / "plan.json").read_text())
    leaves = [s["leaf"] for s in plan["client_inputs"]]
    if leaves != [len(params), len(params) + 1]:  # the hand app reads arr_0, arr_1 as x, y
        raise RuntimeError(f"unexpected client inputs in the exported plan: {leaves}")
    data = work / "nodes"
    data.mkdir()
    x, y = cifar.as_batches(*pop, b)
    for i in range(len(y)):
        np.savez(data / f"node{i}.npz", x[i], y[i])
    return {"app": {"fcir-flower": app, "hand-flower": BENCH / "flower_cifar"}, "data": data}


# --- the run -----------------------------------------------------------------------------


def build(names, cfg: dict, a, work: pathlib.Path) -> tuple[dict, dict, dict]:
    """The systems that are ready to run, those skipped (why), and those that ran out
    of the device's memory while compiling or warming up (recorded, not run)."""
    pop = cifar.population(cfg["clients"], cfg["examples"])
    systems, skipped, out_of_memory = {}, {}, {}
    staged = None
    for name in names:
        t = time.perf_counter()
        try:
            if name in ("fcir", "fcir-k", "fcir-vmap", "fcir-host"):
                systems[name] = Simulated(name, cfg, pop, a.members, a.loop)
            elif name == "drjax":
                systems[name] = InProcess(cfg, pop)
            elif name == "pfl":
                systems[name] = PflWorker(cfg, a.pfl_python, a.pfl_threads)
            else:
                if staged is None:
                    import flwr  # noqa: F401  (skips both Flower systems when absent)

                    staged = stage_flower(cfg, pop, work)
                systems[name] = FlowerRun(name, cfg, work, staged)
        except (Skipped, ImportError) as e:
            skipped[name] = str(e)
            print(f"{name}: skipped: {e}", flush=True)
            continue
        except Exception as e:
            if (record := _record.out_of_memory(e)) is None:
                raise
            out_of_memory[name] = record
            print(f"{name}: {_record.describe(record)}: {record['message']}", flush=True)
            continue
        print(f"{name}: ready in {time.perf_counter() - t:.1f} s", flush=True)
    return systems, skipped, out_of_memory


def _budget(text: str):
    """``--clients-per-step``: a positive int, or ``auto`` (xla.compile picks k)."""
    return text if text == "auto" else int(text)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="tiny sizes, one repetition")
    ap.add_argument("--json", help="write the median ratios (and the record) here")
    ap.add_argument("--out-dir", default=str(BENCH / "results"))
    ap.add_argument("--systems", default=",".join(SYSTEMS), help="comma-separated subset")
    ap.add_argument("--pfl-python", default=str(ROOT / ".venv-pfl" / "bin" / "python"))
    ap.add_argument("--pfl-threads", type=int,
                    help="torch's intra-op threads in pfl's worker (default: torch's)")
    ap.add_argument("--members", default="auto", choices=("auto", "loop", "vmap"),
                    help="fcir's fed.map lowering (xla.compile's members=)")  # fmt: skip
    ap.add_argument("--loop", default="auto", choices=("auto", "host", "device"),
                    help="fcir's loop over the rounds (xla.simulate's loop=)")  # fmt: skip
    for key in FULL:
        kind = _budget if key == "clients_per_step" else int
        ap.add_argument(f"--{key.replace('_', '-')}", type=kind)
    a = ap.parse_args()
    cfg = dict(SMOKE if a.smoke else FULL)
    cfg.update({k: getattr(a, k) for k in FULL if getattr(a, k) is not None})
    if min(v for v in cfg.values() if v != "auto") < 1 or cfg["cohort"] > cfg["clients"]:
        ap.error("sizes must be positive and the cohort at most the population")
    names = [s for s in a.systems.split(",") if s]
    if unknown := set(names) - set(SYSTEMS + EXTRA):
        ap.error(f"unknown systems {sorted(unknown)}; known: {', '.join(SYSTEMS + EXTRA)}")
    label = {"fcir-k": f"fcir k={cfg['clients_per_step']}", "fcir-vmap": "fcir vmap",
             "fcir-host": "fcir host"}  # fmt: skip

    load_before = os.getloadavg()
    print(f"config: {cfg}, members={a.members}, loop={a.loop}; "
          f"load average {load_before[0]:.1f} on {os.cpu_count()} cores")  # fmt: skip
    work = pathlib.Path(tempfile.mkdtemp(prefix="fcir-bench-simulate-"))
    systems, skipped, out_of_memory = build(names, cfg, a, work)
    chosen = getattr(systems.get("fcir-k"), "streaming", None)
    if chosen and chosen.get("mode") == "auto":
        label["fcir-k"] = f"fcir k=auto ({chosen['clients_per_step']})"
    seconds = {n: [] for n in systems}
    try:
        for r in range(cfg["reps"]):
            for name in _timing.rotated(list(systems), r):
                if name in out_of_memory:
                    continue
                try:
                    seconds[name].append(systems[name].sample())
                except Exception as e:  # a run that fails to allocate: recorded, not retried
                    if (record := _record.out_of_memory(e)) is None:
                        raise
                    out_of_memory[name] = record
                    seconds.pop(name)
                    print(f"rep {r}: {label.get(name, name)} {_record.describe(record)}")
                    continue
                rps = cfg["rounds"] / seconds[name][-1]
                print(f"rep {r}: {label.get(name, name)} {rps:.3f} rounds/s", flush=True)
    finally:
        for s in systems.values():
            s.close()
        shutil.rmtree(work, ignore_errors=True)
    load_after = os.getloadavg()

    rps = {n: [cfg["rounds"] / s for s in v] for n, v in seconds.items()}
    ratios = {}
    for num, den in RATIOS:
        if num in rps and den in rps:
            ratios[f"{num}/{den}"] = _timing.ratio_stats(rps[num], rps[den])
    print(f"\n{'system':<14} {'rounds/s median':>16} {'min':>8} {'max':>8} {'rounds/hour':>12}")
    for n, v in rps.items():
        m = statistics.median(v)
        print(f"{label.get(n, n):<14} {m:>16.3f} {min(v):>8.3f} {max(v):>8.3f} {m * 3600:>12.0f}")
    for n, why in skipped.items():
        print(f"{label.get(n, n):<14} skipped: {why}")
    for n, record in out_of_memory.items():
        print(f"{label.get(n, n):<14} {_record.describe(record)}")
    print()
    for key, s in ratios.items():
        goal = f" (goal >= {GOALS[key]})" if key in GOALS else ""
        shown = key
        for name in ("fcir-k", "fcir-vmap", "fcir-host"):
            shown = shown.replace(name, label[name])
        print(f"{shown}: {_timing.format_ratio(s)}{goal}")
    versions = _record.versions("drjax", "flwr", "fcir")
    if "pfl" in systems:
        versions.update({f"pfl-worker {k}": v for k, v in systems["pfl"].versions.items()})
    print("\nversions:", ", ".join(f"{k} {v}" for k, v in versions.items() if v is not None))
    print(f"load average: {load_before[0]:.1f} before, {load_after[0]:.1f} after")

    result = {
        **{f"{n}/{d}": ratios.get(f"{n}/{d}", {}).get("median") for n, d in RATIOS[:3]},
        "smoke": a.smoke, "config": cfg, "members": a.members, "loop": a.loop,
        "systems": list(systems),
        "skipped": skipped, "out_of_memory": out_of_memory, "fcir-k streaming": chosen,
        "seconds": seconds, "rounds_per_s": rps, "ratios": ratios, "versions": versions,
        **_record.machine(), "load_average": [load_before[0], load_after[0]],
    }  # fmt: skip
    _record.write(a.out_dir, "simulate", result, "smoke" if a.smoke else None)
    if a.json:
        pathlib.Path(a.json).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
