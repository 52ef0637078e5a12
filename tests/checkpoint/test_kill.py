"""SIGKILL during asynchronous saves never costs a committed checkpoint (20 trials).

tools/ckpt_stress.py runs the same trials in any number.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from kill_worker import run_trial

pytestmark = pytest.mark.slow  # docs/contributing.md: left out of the fast tier

TRIALS = 20


def test_sigkill_at_random_moments_during_async_saves(tmp_path, devices):
    delays = np.random.default_rng(20240601).uniform(0.0, 0.6, TRIALS)
    with ThreadPoolExecutor(2) as pool:  # two children at a time
        outcomes = list(
            pool.map(lambda i: run_trial(tmp_path / f"trial{i}", float(delays[i])), range(TRIALS))
        )
    mid_save = sum(o.killed_mid_save for o in outcomes)
    # Saves fill the child's time, so most kills land inside one; make sure enough do.
    assert mid_save >= TRIALS // 4, [(o.delay, o.committed, o.killed_mid_save) for o in outcomes]
    assert sum(len(o.committed) for o in outcomes) >= TRIALS
