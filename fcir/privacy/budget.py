"""``fcir.privacy.Budget``: a privacy budget that training spends round by round.

```python
budget = fcir.privacy.Budget(module, delta=1e-5, max_epsilon=8.0)
for r in range(rounds):
    eps = budget.spend()        # PrivacyError, and nothing spent, past max_epsilon
    state = run_round(state)
json.dump(budget.state(), f)    # with the training checkpoint
budget = fcir.privacy.Budget.from_state(module, json.load(f))
```

ε after ``k`` rounds is ``fcir.privacy.epsilon(module, k, delta, sampling_rate,
accountant=...)`` (composed from scratch each time: the accountant's figure for the
whole run, not a sum of per-round figures). The state names the module by the sha256 of
its canonical text, so a budget cannot be resumed for another program.
"""

from __future__ import annotations

import hashlib
import math

from fcir.errors import PrivacyError
from fcir.ir import Module
from fcir.privacy.analysis import _probability, epsilon, rounds_arg, sampler_tv
from fcir.privacy.sampler_error import delta_with_sampler

__all__ = ["Budget"]

_STATE_VERSION = 1


def _fingerprint(module: Module) -> str:
    return hashlib.sha256(module.to_text().encode()).hexdigest()


class Budget:
    """Spends ε of ``module``'s rounds up to ``max_epsilon`` at ``delta``."""

    def __init__(
        self,
        module: Module,
        delta: float,
        max_epsilon: float,
        sampling_rate: float = 1.0,
        accountant: str = "rdp",
    ):
        if not isinstance(module, Module):
            raise PrivacyError(
                f"fcir.privacy.Budget: module must be an fcir.Module (fcir.capture(...)), "
                f"got {type(module).__name__}"
            )
        try:
            max_eps = float(max_epsilon)
        except (TypeError, ValueError):
            max_eps = math.nan
        if isinstance(max_epsilon, bool) or not (max_eps > 0 and math.isfinite(max_eps)):
            raise PrivacyError(
                f"fcir.privacy.Budget: max_epsilon must be a finite number > 0, got {max_epsilon!r}"
            )
        self.module = module
        self.delta = _probability("fcir.privacy.Budget", "delta", delta, "(0, 1)")
        self.max_epsilon = max_eps
        self.sampling_rate = _probability(
            "fcir.privacy.Budget", "sampling_rate", sampling_rate, "(0, 1]"
        )
        self.accountant = accountant
        self._rounds = 0
        self._epsilon = 0.0
        # Validates delta, sampling rate, accountant and the module's DP ops now, not at
        # the first spend.
        epsilon(module, 1, self.delta, self.sampling_rate, accountant=accountant)

    @property
    def rounds(self) -> int:
        """Rounds spent so far."""
        return self._rounds

    @property
    def epsilon(self) -> float:
        """ε of the rounds spent so far (0.0 before the first)."""
        return self._epsilon

    @property
    def sampler_tv(self) -> float:
        """Total variation between the rounds spent as run (the sampled discrete Gaussian
        noise of ``ddp_*`` ops) and the exact mechanism: ``fcir.privacy.sampler_tv``."""
        return sampler_tv(self.module, self._rounds)

    @property
    def delta_with_sampler(self) -> float:
        """δ of the rounds spent as run: ``delta + (1 + e**epsilon) sampler_tv`` (equal
        to ``delta`` without ``ddp_*`` ops; ``fcir.privacy.sampler_error``)."""
        return delta_with_sampler(self._epsilon, self.delta, self.sampler_tv)

    def epsilon_after(self, rounds: int = 1) -> float:
        """ε if ``rounds`` more rounds were spent (nothing is spent)."""
        rounds = rounds_arg("fcir.privacy.Budget", rounds)
        return epsilon(
            self.module,
            self._rounds + rounds,
            self.delta,
            self.sampling_rate,
            accountant=self.accountant,
        )

    def can_spend(self, rounds: int = 1) -> bool:
        """Whether ``rounds`` more rounds stay within ``max_epsilon``."""
        return self.epsilon_after(rounds) <= self.max_epsilon

    def spend(self, rounds: int = 1) -> float:
        """Spends ``rounds`` rounds and returns ε after them; raises PrivacyError and
        spends nothing if that ε would pass ``max_epsilon``."""
        rounds = rounds_arg("fcir.privacy.Budget", rounds)
        eps = self.epsilon_after(rounds)
        if eps > self.max_epsilon:
            raise PrivacyError(
                f"fcir.privacy.Budget: {rounds} more round(s) of @{self.module.name} would "
                f"bring ε to {eps:.4g} at delta={self.delta:g}, past max_epsilon="
                f"{self.max_epsilon:g} (spent: {self._rounds} round(s), ε={self._epsilon:.4g});"
                " stop training here or raise the budget"
            )
        self._rounds += rounds
        self._epsilon = eps
        return eps

    def state(self) -> dict:
        """A JSON-able description to restore with :meth:`from_state`."""
        return {
            "version": _STATE_VERSION,
            "module_sha256": _fingerprint(self.module),
            "delta": self.delta,
            "max_epsilon": self.max_epsilon,
            "sampling_rate": self.sampling_rate,
            "accountant": self.accountant,
            "rounds": self._rounds,
            "epsilon": self._epsilon,
            "delta_with_sampler": self.delta_with_sampler,  # what is run; not read back
        }

    @classmethod
    def from_state(cls, module: Module, state: dict) -> Budget:
        """The budget ``state()`` described, for ``module`` (the same program)."""
        if not isinstance(state, dict) or state.get("version") != _STATE_VERSION:
            raise PrivacyError(
                f"fcir.privacy.Budget.from_state: not a budget state of version "
                f"{_STATE_VERSION} (Budget.state() writes one)"
            )
        try:
            budget = cls(
                module,
                state["delta"],
                state["max_epsilon"],
                state["sampling_rate"],
                state["accountant"],
            )
            rounds = rounds_arg("fcir.privacy.Budget", state["rounds"])
        except KeyError as e:
            raise PrivacyError(f"fcir.privacy.Budget.from_state: the state lacks {e}") from None
        if state.get("module_sha256") != _fingerprint(module):
            raise PrivacyError(
                f"fcir.privacy.Budget.from_state: the state belongs to another program than "
                f"@{module.name} (its IR differs): a budget is spent by one program"
            )
        budget._rounds = rounds
        budget._epsilon = (
            epsilon(
                module, rounds, budget.delta, budget.sampling_rate, accountant=budget.accountant
            )
            if rounds
            else 0.0
        )
        return budget

    def __repr__(self) -> str:
        return (
            f"Budget(@{self.module.name}: {self._rounds} round(s), ε={self._epsilon:.4g} "
            f"of {self.max_epsilon:g} at delta={self.delta:g})"
        )
