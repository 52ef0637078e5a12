"""The scripts in examples/ run end to end at a reduced size, train (the loss goes down),
print one plain progress line per round when stdout is not a terminal, and can be
compiled by ``fcir compile`` from their ``EXAMPLE_ARGS``. Also ``RoundProgress``."""

from __future__ import annotations

import io
import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import pytest
from examples_testing import EXAMPLES, load

import fcir
from fcir import cli
from fcir.report.progress import RoundProgress

pytestmark = pytest.mark.slow  # docs/contributing.md: left out of the fast tier

# example file -> (round function, reduced command-line arguments)
TRAINING = {
    "fedavg_transformer": ("fedavg_transformer_round", ["--rounds", "3", "--clients", "2"]),
    "fedadam": ("fedadam_round", ["--rounds", "3", "--clients", "3"]),
    "diloco": ("diloco_round", ["--rounds", "3", "--clients", "2", "--inner-steps", "5"]),
    "hierarchical": ("hierarchical_round", ["--rounds", "3", "--silos", "2", "--clients", "2"]),
}
ANALYTICS = {
    "secure_histogram": ("secure_histogram_round", ["--rounds", "2", "--clients", "6",
                                                    "--items", "5"]),
}  # fmt: skip
ALL = {**TRAINING, **ANALYTICS}


@pytest.mark.parametrize("name", sorted(TRAINING))
def test_training_example_runs_and_the_loss_goes_down(name, capsys):
    losses = load(name).main(TRAINING[name][1])
    out = capsys.readouterr().out
    assert len(losses) == 3 and all(np.isfinite(losses))
    assert losses[-1] < losses[0], f"{name}: loss did not go down: {losses}"
    assert "\r" not in out, "no carriage-return animation when stdout is not a terminal"
    lines = out.splitlines()
    assert [line.split(" | ")[0] for line in lines[:3]] == ["round 1/3", "round 2/3", "round 3/3"]
    assert all(" | loss " in line and " KiB down, " in line for line in lines[:3])
    assert lines[3].startswith("3 rounds in ") and "communicated" in lines[3]


def test_fedavg_over_a_population_samples_a_cohort_each_round(capsys):
    """--population 40 --clients 4: each round trains a sampled cohort of 4 (xla.simulate),
    and the loss goes down."""
    losses = load("fedavg").main(["--rounds", "3", "--clients", "4", "--population", "40"])
    assert len(losses) == 3 and losses[-1] < losses[0]
    lines = capsys.readouterr().out.splitlines()
    assert lines[2].startswith("round 3/3 | loss ") and "cohort of 4 from 40" in lines[2]


def test_secure_histogram_sums_exactly(capsys):
    example = load("secure_histogram")
    hist = example.main(ANALYTICS["secure_histogram"][1])
    assert hist.sum() == 2 * 6 * 5  # two days, six clients, five values each
    rng = np.random.default_rng(0)
    example.client_values(rng, 6, 5)  # the capture's example data
    plain = sum(np.bincount(example.client_values(rng, 6, 5).ravel(), minlength=10)
                for _ in range(2))  # fmt: skip
    np.testing.assert_array_equal(hist, plain)
    out = capsys.readouterr().out
    assert "day 2/2" in out and "\r" not in out


def test_example_as_a_script_prints_plain_lines_into_a_pipe():
    done = subprocess.run(
        [sys.executable, str(EXAMPLES / "secure_histogram.py"), "--rounds", "2",
         "--clients", "4", "--items", "3"],
        capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].startswith("day 1/2 | values 12 | ") and lines[1].startswith("day 2/2")
    assert lines[2].startswith("2 days in ") and "\r" not in done.stdout


@pytest.mark.parametrize("name", sorted(ALL))
def test_fcir_compile_captures_example_from_its_example_args(name, tmp_path, capsys):
    fn = ALL[name][0]
    target = f"{EXAMPLES / name}.py:{fn}"
    assert cli.main(["compile", target, "--emit", "ir", "-o", str(tmp_path)]) == 0
    module = fcir.parse((tmp_path / f"{fn}.fcir").read_text())
    fcir.check(module)
    assert module.name == fn


# --- RoundProgress ---------------------------------------------------------------------------


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_redraws_one_line_on_a_terminal(monkeypatch):
    monkeypatch.setenv("TERM", "xterm")
    stream = Terminal()
    progress = RoundProgress(3, bytes_per_round=2048, stream=stream)
    for r in progress:
        progress.log(loss=jnp.float32(3.0 - r))
    text = stream.getvalue()
    assert text.count("\r") == 3 and text.count("\n") == 2  # end of the live line, summary
    assert "\rround 3/3 | loss 1 | " in text and "sent 2.0 KiB" in text
    assert text.splitlines()[-1].startswith("3 rounds in ")
    assert "loss 3 -> 1 | 6.0 KiB communicated" in text
    assert [h["loss"] for h in progress.history] == [3.0, 2.0, 1.0]


def test_progress_prints_plain_lines_elsewhere_and_splits_traffic_by_direction():
    @fcir.program(placements={"clients": 2})
    def avg(w):
        return fcir.reduce_mean(fcir.map_fn(lambda w: w * 2, fcir.broadcast(w)))

    module = fcir.capture(avg, jnp.ones(256))  # 1 KiB to each of 2 clients and back
    stream = io.StringIO()
    for _ in (progress := RoundProgress(2, module=module, stream=stream)):
        progress.log(loss=0.5)
    lines = stream.getvalue().splitlines()
    assert lines[0].startswith("round 1/2 | loss 0.5000 | ")
    assert lines[0].endswith(" s | sent 2.0 KiB down, 2.0 KiB up")
    assert lines[2].endswith("| loss 0.5000 -> 0.5000 | 8.0 KiB communicated")
    assert "\r" not in stream.getvalue()


def test_progress_summary_after_an_early_break():
    stream = io.StringIO()
    for r in (progress := RoundProgress(10, stream=stream, live=False)):
        if r == 1:
            break
    lines = stream.getvalue().splitlines()
    assert len(lines) == 2 and lines[0].startswith("round  1/10 | ")
    assert lines[1].startswith("1 round in ")
    assert len(progress.history) == 1


# --- examples/dp_fedavg_digits.py --------------------------------------------------------


def test_digits_plot_title_names_the_clients_given_and_round_ticks_are_whole():
    pytest.importorskip("matplotlib")
    digits = load("dp_fedavg_digits")
    fig = digits.figure([0.5, 0.6], [0.4, 0.5], [1.0, 1.5], 1e-5, 4.0, num_clients=7)
    fig.canvas.draw()
    accuracy, privacy = fig.axes
    assert accuracy.get_title() == "digits, 7 non-IID clients"
    for ax in (accuracy, privacy):
        ticks = [t for t in ax.get_xticks() if ax.get_xlim()[0] <= t <= ax.get_xlim()[1]]
        assert ticks and all(float(t).is_integer() for t in ticks), ticks


def test_both_digits_rounds_compile_from_the_command_line(tmp_path):
    pytest.importorskip("sklearn")
    for fn in ("fedavg_round", "dp_fedavg_round"):
        target = f"{EXAMPLES / 'dp_fedavg_digits'}.py:{fn}"
        assert cli.main(["compile", target, "--emit", "ir", "-o", str(tmp_path)]) == 0
        fcir.check(fcir.parse((tmp_path / f"{fn}.fcir").read_text()))


def test_digits_trains_a_population_ten_times_the_cohort_with_epsilon_at_q(tmp_path, capsys):
    """--clients 100 --cohort 10: Poisson cohorts at q = 0.1 of a fixed size; the loss
    is the sampled clients' mean (padding members train to nothing) and ε is the
    accountant's at q, below ε with every client every round."""
    pytest.importorskip("sklearn")
    pytest.importorskip("matplotlib")
    digits = load("dp_fedavg_digits")
    curves = digits.main(["--clients", "100", "--cohort", "10", "--rounds", "2",
                          "--output", str(tmp_path / "p.png")])  # fmt: skip
    assert len(curves["fedavg"]) == 2 and "ddp_16" not in curves
    cohorts = fcir.Population(np.zeros((100, 1))).poisson(0.1)
    _, private = digits.make_rounds(cohorts.size, 0.5, 4.0)
    model, key, clients = digits.make_example_args(cohorts.size)
    module = fcir.capture(private, model, key, clients)
    want = [fcir.privacy.epsilon(module, r, 1e-5, sampling_rate=0.1) for r in (1, 2)]
    assert curves["epsilon"] == pytest.approx(want, rel=1e-12)
    assert want[-1] < fcir.privacy.epsilon(module, 2, 1e-5) / 2
    losses = [
        float(line.split("(loss ")[1].split(")")[0])
        for line in capsys.readouterr().out.splitlines()
        if line.startswith("round ")
    ]
    assert len(losses) == 2 and all(0.05 < x < 5 for x in losses), losses


# --- examples/dp_flower_training.py ----------------------------------------------------
# Its two Simulation Engine runs are its cost (a Ray cluster, Flower's processes, jax in
# each): it is checked on the run docs/flower.md's command makes, in
# tests/interpreters/flower/test_flower_doc_commands.py (test_the_dp_example_runs_as_the_page_says):
# it stops on its budget, the resume keeps spending it, its model is the production
# bundle's rounds bit for bit and reference.run's to 1e-5, nothing is left running.
