"""The training loop's state mapping: which outputs of a round feed which server
inputs of the next.

``state="I=O,..."`` names it; without it, a run of several rounds takes the mapping
from the round's pytree paths: output ``O`` feeds server input ``I`` when its path in
the results (``[0]['w']``) is the input's path in the arguments and their types agree
(``(params, data) -> (params, loss)`` maps params to params). A run of several rounds
with no mapping would run round 1 again and again on the same inputs, so it is refused,
naming the outputs whose type would fit; ``state="none"`` repeats the round on purpose.

This module is copied into every exported app: it imports nothing but the standard
library, and ``fcir export`` uses it too (for the "run it:" hint).
"""

from __future__ import annotations


class StateError(ValueError):
    """No state mapping for a run of several rounds, or a malformed one."""


NONE = "none"


def _same_type(a: dict, b: dict) -> bool:
    return (a["dtype"], list(a["shape"])) == (b["dtype"], list(b["shape"]))


def _outputs(plan: dict) -> list[dict]:
    """The outputs in output-file order (arr_0, arr_1, ...)."""
    return [plan["outputs"][j] for j in plan["output_order"]]


def output_names(plan: dict) -> list[str]:
    """Each output's name in the log lines and metrics, in output-file order: the
    program's own (``train_loss``, ``params.w``: the pytree keys, which the export
    writes), else its position ``arr_<o>``."""
    return [o.get("name", f"arr_{k}") for k, o in enumerate(_outputs(plan))]


def infer(plan: dict) -> dict[int, int]:
    """Server input position -> output position, for every server input whose pytree
    path and type an output has."""
    outs = _outputs(plan)
    by_path = {o.get("path"): k for k, o in enumerate(outs)}
    mapping = {}
    for i, s in enumerate(plan["server_inputs"]):
        k = by_path.get(s.get("path"))
        if s.get("path") is not None and k is not None and _same_type(s, outs[k]):
            mapping[i] = k
    return mapping


def candidates(plan: dict) -> list[tuple[int, int]]:
    """(server input position, output position) pairs whose types agree."""
    outs = _outputs(plan)
    return [
        (i, k)
        for i, s in enumerate(plan["server_inputs"])
        for k, o in enumerate(outs)
        if _same_type(s, o)
    ]


def fixed_key(plan: dict, mapping: dict[int, int]) -> dict | None:
    """The first DP release of a private plan (its privacy ``keys`` entry) whose key
    depends on no server input that ``mapping`` feeds, or None: such a key, and the
    noise it draws, is the same in every round of a run."""
    fed = {plan["server_inputs"][i]["leaf"] for i in mapping}
    for k in (plan.get("privacy") or {}).get("keys", ()):
        if fed.isdisjoint(k["arguments"]):
            return k
    return None


def describe(plan: dict, mapping: dict[int, int]) -> str:
    """``0=0 ([0]['w']), 1=1 (...)``."""
    return ", ".join(
        f"{i}={o} ({plan['server_inputs'][i].get('path', '?')})" for i, o in sorted(mapping.items())
    )


def text(mapping: dict[int, int]) -> str:
    """The run config value of ``mapping``: ``"0=0,1=1"``."""
    return ",".join(f"{i}={o}" for i, o in sorted(mapping.items()))


def refusal(plan: dict, rounds: int) -> str:
    outs = _outputs(plan)
    pairs = candidates(plan)
    if pairs:
        fits = "; ".join(
            f"output arr_{k} {outs[k].get('path', '')} ({outs[k]['type']}) could feed server "
            f"input arr_{i} {plan['server_inputs'][i].get('path', '')}"
            for i, k in pairs
        )
        hint = f'{fits}: give the mapping, e.g. state="{text(dict(pairs[:1]))}"'
    else:
        hint = "no output has the type of a server input"
    return (
        f"num-server-rounds={rounds} without a state mapping would run round 1 {rounds} times on the same "
        f"inputs, and no output of @{plan['round']} has a server input's pytree path and "
        f'type; {hint} (state="I=O,..."), or state="{NONE}" to repeat the round on purpose'
    )


def parse(value: str, n_in: int, n_out: int) -> dict[int, int]:
    out: dict[int, int] = {}
    for item in value.replace(";", ",").split(","):
        if not item.strip():
            continue
        left, eq, right = item.partition("=")
        try:
            i, o = int(left), int(right)
        except ValueError:
            i = o = -1
        if not eq or not (0 <= i < n_in) or not (0 <= o < n_out) or i in out:
            raise StateError(
                f"run config state={value!r}: write 'I=O,...' with I a server input position "
                f"(0..{n_in - 1}) and O an output position (0..{n_out - 1}), each I once"
            )
        out[i] = o
    return out


def resolve(value: str, plan: dict, rounds: int) -> tuple[dict[int, int], str]:
    """The mapping a run uses, and how it was chosen (``""`` when given explicitly)."""
    value = value.strip()
    if value.lower() == NONE:
        return {}, ""
    n_in, n_out = len(plan["server_inputs"]), len(plan["outputs"])
    if value:
        mapping = parse(value, n_in, n_out)
        outs = _outputs(plan)
        for i, o in mapping.items():
            si, so = plan["server_inputs"][i], outs[o]
            if not _same_type(si, so):
                raise StateError(
                    f"run config state: output arr_{o} ({so['type']}) cannot feed server "
                    f"input arr_{i} ({si['type']})"
                )
        return mapping, ""
    if rounds <= 1:
        return {}, ""
    mapping = infer(plan)
    if not mapping:
        raise StateError(refusal(plan, rounds))
    return mapping, f"state {text(mapping)} inferred from pytree paths: {describe(plan, mapping)}"


class History:
    """Per-round metrics: what the progress line shows, kept for Flower's
    ``MetricRecord`` in the ServerApp context state (each name -> its values by
    round, and ``round`` -> the round numbers) and for run config ``metrics-file``
    (the same as JSON, rewritten after every round)."""

    def __init__(self, path: str = ""):
        self.path = path
        self.rounds: list[int] = []
        self.values: dict[str, list[float]] = {}
        if path:  # a resumed run keeps the rounds it ran before
            import json
            import pathlib

            try:
                saved = json.loads(pathlib.Path(path).read_text())
                self.rounds = [int(r) for r in saved.pop("round")]
                self.values = {k: [float(x) for x in v] for k, v in saved.items()}
            except (OSError, ValueError, KeyError, TypeError, AttributeError):
                self.rounds, self.values = [], {}

    def add(self, rnd: int, metrics: dict[str, float]) -> None:
        keep = sum(1 for r in self.rounds if r < rnd)  # a round run again replaces its entry
        self.rounds = self.rounds[:keep]
        self.values = {k: v[:keep] for k, v in self.values.items()}
        self.rounds.append(rnd)
        for name, value in metrics.items():
            self.values.setdefault(name, []).append(float(value))
        if self.path:
            import json
            import os

            tmp = f"{self.path}.tmp-{os.getpid()}"
            with open(tmp, "w") as f:
                json.dump({"round": self.rounds, **self.values}, f, indent=1)
            os.replace(tmp, self.path)

    def record(self) -> dict:
        """The MetricRecord's content (ints and floats only)."""
        return {"round": list(self.rounds), **{k: list(v) for k, v in self.values.items()}}
