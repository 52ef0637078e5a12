"""``clients_per_step="auto"``'s search (interpreters/xla/memory_budget.py) against a
compiler that refuses what does not fit, as an accelerator's does: on a TPU a candidate
over the chip's memory fails to compile with ``RESOURCE_EXHAUSTED: XLA:TPU compile
permanent error. Ran out of memory in memory space hbm. Used 20.27G of 15.75G hbm.``
(jax.errors.JaxRuntimeError), where XLA:CPU compiles anything and only its memory
analysis says what would not fit. The fake here compiles on the CPU and raises that
error, in that wording, for any program whose predicted peak is over its capacity."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from fcir.interpreters import xla
from fcir.interpreters.xla import memory_budget

import fcir

GIB = 2**30


def tpu_size(n: float) -> str:
    """Bytes as XLA's TPU compiler prints them: binary units, two decimals."""
    for unit, scale in (("G", 2**30), ("M", 2**20), ("K", 2**10)):
        if n >= scale:
            return f"{n / scale:.2f}{unit}"
    return f"{int(n)}B"


def tpu_out_of_memory(asked: float, capacity: float) -> jax.errors.JaxRuntimeError:
    return jax.errors.JaxRuntimeError(
        "RESOURCE_EXHAUSTED: XLA:TPU compile permanent error. Ran out of memory in memory "
        f"space hbm. Used {tpu_size(asked)} of {tpu_size(capacity)} hbm. Exceeded hbm "
        f"capacity by {tpu_size(asked - capacity)}.\n\nTotal hbm usage >= {tpu_size(asked)}:"
    )


def asked_as_printed(n: float) -> int:
    """The bytes the search reads back from ``tpu_size(n)``."""
    text = tpu_size(n)
    return int(float(text[:-1]) * {"G": 2**30, "M": 2**20, "K": 2**10}[text[-1]])


# -- the search alone, on the FAX round's figures measured on a TPU v5e ------------------


def fax_round_on_a_v5e(k: int) -> memory_budget.Probe:
    """The FAX 368M-parameter round, 16 clients, as one TPU v5e chip (15.75 GiB) compiled
    it: k = 1 and 2 fit (7.19 and 12.64 GiB), k = 4 ran out at 20.27 GiB, and so would
    any larger k (5.45 GiB more per member)."""
    peaks = {1: 7.19 * GIB, 2: 12.64 * GIB, 4: 20.27 * GIB}
    peak = peaks.get(k, 7.19 * GIB + (k - 1) * 5.45 * GIB)
    if peak > 15.75 * GIB:
        return memory_budget.out_of_memory(tpu_out_of_memory(peak, 15.75 * GIB))
    return memory_budget.Probe(peak=int(peak))


def test_the_fax_round_on_a_v5e_gets_two_clients_per_step_from_two_compiles():
    compiled = []

    def compile_k(k):
        compiled.append(k)
        return fax_round_on_a_v5e(k)

    search = memory_budget.search_budget(compile_k, top=16, limit=int(15.75 * GIB))
    assert search.k == 2
    assert compiled == [1, 2]  # the line through them says 2: nothing larger compiled


def test_a_candidate_that_runs_out_of_memory_is_the_next_bound_and_its_bytes_the_slope():
    # Memory grows faster than the line through k = 1 and 2 says: its candidate (10)
    # runs out; the line between 2 and what 10 asked for gives 4, which fits, and the
    # one between 4 and 10 gives 5, which fits too: the largest, as 6 would not.
    def peak(k):
        return 10 * GIB + k * k * GIB

    compiled = []

    def compile_k(k):
        compiled.append(k)
        if peak(k) > 40 * GIB:
            return memory_budget.out_of_memory(tpu_out_of_memory(peak(k), 40 * GIB))
        return memory_budget.Probe(peak=int(peak(k)))

    search = memory_budget.search_budget(compile_k, top=64, limit=40 * GIB)
    assert compiled == [1, 2, 10, 4, 5] and search.k == 5 and peak(6) > 40 * GIB
    assert search.tried[10].peak == asked_as_printed(peak(10))


def test_when_the_compiler_gives_no_figure_the_search_halves():
    def compile_k(k):
        if k > 5:
            return memory_budget.out_of_memory(
                jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: OOM")
            )
        return memory_budget.Probe(peak=k)  # flat: the line says every member fits

    search = memory_budget.search_budget(compile_k, top=40, limit=100)
    assert search.k == 5 and sorted(search.tried) == [1, 2, 4, 5, 6, 11, 21, 40]


@pytest.mark.parametrize(
    "text, asked",
    [
        ("RESOURCE_EXHAUSTED: XLA:TPU compile permanent error. Ran out of memory in memory "
         "space hbm. Used 20.27G of 15.75G hbm. Exceeded hbm capacity by 4.52G.",
         int(20.27 * 2**30)),
        ("RESOURCE_EXHAUSTED: TPU TensorCore Hbm usage: 34.82G, SparseCore Hbm usage "
         "174.10G, exceeding available bytes: 95.74G", int((34.82 + 174.10) * 2**30)),
        ("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 21474836480 bytes.",
         21474836480),
        ("RESOURCE_EXHAUSTED: Ran out of memory on HBM, the total memory required for HLO "
         "temporaries (38.73G) exceeds available HBM (15.75G).", int(38.73 * 2**30)),
        ("RESOURCE_EXHAUSTED: Ran out of memory in memory space vmem", None),
    ],
)  # fmt: skip
def test_out_of_memory_reads_what_the_compiler_asked_for(text, asked):
    probe = memory_budget.out_of_memory(jax.errors.JaxRuntimeError(text))
    assert probe.peak == asked and probe.message == text


def test_other_compile_errors_are_not_out_of_memory():
    assert (
        memory_budget.out_of_memory(jax.errors.JaxRuntimeError("INTERNAL: Mosaic failed")) is None
    )
    assert memory_budget.out_of_memory(ValueError("RESOURCE_EXHAUSTED: not from XLA")) is None


# -- through xla.compile, with a fake TPU compiler over XLA:CPU --------------------------


@fcir.program(placements={"clients": 16})
def _round(w, x):
    def local(w, x):
        step = lambda v, _: (jnp.tanh(v + jnp.outer(x, x) @ v), None)  # noqa: E731
        return jax.lax.scan(step, w, None, length=2)[0] - w

    return w + fcir.reduce_mean(fcir.map_fn(local, (fcir.broadcast(w), x)))


@pytest.fixture(scope="module")
def module():
    if jax.default_backend() != "cpu":
        # On a TPU, k = 1 and k = 2 of this round had the same predicted peak (its buffers
        # of a few KiB stay in the core's own memory); there the real compiler refuses what
        # does not fit, which bench/device.sh's clients_per_step="auto" part meets.
        pytest.skip("a fake TPU compiler over XLA:CPU's memory analysis")
    return fcir.capture(_round, np.zeros((32, 32), np.float32), np.ones((16, 32), np.float32))


@pytest.fixture(scope="module")
def peaks(module):
    """The predicted peaks of k = 1 and k = 2 on this backend (each step holds k
    members' [32, 32] states: k = 2 needs more)."""
    one, two = (
        memory_budget.predicted_peak(xla.compile(module, clients_per_step=k).compiled())
        for k in (1, 2)
    )
    assert one < two
    return one, two


@pytest.fixture
def chip(monkeypatch):
    """``chip(capacity, fail=None)``: compiles refuse programs whose predicted peak is
    over ``capacity`` bytes as a TPU does (``fail(peak)``: raise that instead, or None
    to go on); the device has ``capacity`` bytes. Returns the peaks of the programs
    compiled, in order."""
    compile_ = jax.stages.Lowered.compile

    def install(capacity, fail=None):
        seen = []

        def compile_like_a_tpu(lowered, *args, **kwargs):
            compiled = compile_(lowered, *args, **kwargs)
            peak = memory_budget.predicted_peak(compiled)
            seen.append(peak)
            error = fail(peak) if fail else None
            if error is None and peak > capacity:
                error = tpu_out_of_memory(peak, capacity)
            if error is not None:
                raise error
            return compiled

        monkeypatch.setattr(jax.stages.Lowered, "compile", compile_like_a_tpu)
        monkeypatch.setattr(memory_budget, "device_memory", lambda mesh: capacity)
        return seen

    return install


def test_auto_takes_a_compile_that_runs_out_of_memory_as_does_not_fit(module, peaks, chip):
    one, two = peaks
    seen = chip((one + two) // 2)  # k = 1 fits, k = 2 runs out of memory
    exe = xla.compile(module, clients_per_step="auto")
    s = exe.streaming
    assert s["clients_per_step"] == 1 and s["predicted_peak_bytes"] == one
    assert s["out_of_memory"] == {"2": asked_as_printed(two)} and list(s["candidates"]) == ["1"]
    assert seen == [one, two]
    w, x = np.ones((32, 32), np.float32) / 8, np.ones((16, 32), np.float32) / 4
    np.testing.assert_allclose(exe(w, x), xla.compile(module)(w, x), rtol=1e-5, atol=1e-6)


def test_when_one_member_does_not_fit_the_error_names_its_bytes_and_the_device(module, peaks, chip):
    one, _ = peaks
    chip(one // 2)
    with pytest.raises(fcir.FcirError) as e:
        xla.compile(module, clients_per_step="auto")
    message = str(e.value)
    assert f"needs {asked_as_printed(one):,} bytes per device" in message
    assert f"the device has {one // 2:,} bytes" in message and "Used " in message


def test_a_message_without_the_bytes_says_so(module, peaks, chip):
    chip(peaks[0] // 2, fail=lambda peak: jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: none"))
    with pytest.raises(fcir.FcirError, match="does not say how many bytes it asked for"):
        xla.compile(module, clients_per_step="auto")


def test_a_compile_error_that_is_not_out_of_memory_propagates(module, peaks, chip):
    def fail(peak):
        broken = jax.errors.JaxRuntimeError("INTERNAL: the compiler broke")
        return broken if peak > peaks[0] else None

    chip(10 * peaks[1], fail=fail)
    with pytest.raises(fcir.FcirError, match="INTERNAL: the compiler broke"):
        xla.compile(module, clients_per_step="auto")
