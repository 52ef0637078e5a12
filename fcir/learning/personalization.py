"""TFF's personalization evaluation of an algorithm's state (``algo.evaluate(clients=n)``,
the plain federated evaluation, is the algorithm object's own).

``personalized_evaluation(algo, fine_tune_steps=k).evaluate(clients=n)`` is the
program ``(state, data, test_data, counts=None, test_counts=None) -> {"before": ...,
"after": ...}``: each member evaluates the model on its ``test_data``, takes ``k``
``client_optimizer`` steps on the first ``k`` entries of its ``data`` and evaluates
the fine-tuned model again; the server averages both sets of metrics (TFF's
``build_personalization_eval``, fine-tuning by the algorithm's own client optimizer).
The fine-tuned models stay at the clients.
"""

from __future__ import annotations

import fcir

from . import arguments
from .algorithm import Algorithm, DataSpec, _mean

__all__ = ["PersonalizedEvaluation", "personalized_evaluation"]


class PersonalizedEvaluation:
    """Metrics before and after ``fine_tune_steps`` local steps on each client."""

    def __init__(self, algo: Algorithm, fine_tune_steps: int):
        who = "learning.personalized_evaluation"
        if not isinstance(algo, Algorithm):
            raise fcir.LearningError(
                f"{who}: algo must be an fcir.learning algorithm (learning.fedavg(...), ...), "
                f"got {type(algo).__name__}"
            )
        self.algo = algo
        self.fine_tune_steps = arguments.count(who, "fine_tune_steps", fine_tune_steps, 0)

    def evaluate(self, clients: int):
        """``(state, data, test_data, counts=None, test_counts=None) -> {"before",
        "after"}`` over ``clients`` members."""
        algo, k = self.algo, self.fine_tune_steps
        who = "learning.personalized_evaluation"
        n = arguments.count(f"{who}(...).evaluate", "clients", clients, 1)

        def fn(state, data, test_data, counts=None, test_counts=None):
            algo._check_state(state)
            spec = DataSpec.of(who, data, counts, n)
            test_spec = DataSpec.of(f"{who} (test_data)", test_data, test_counts, n)
            if spec.steps < k:
                raise fcir.LearningError(
                    f"{who}: fine_tune_steps={k} needs at least {k} local steps of data, "
                    f"got {spec.steps}"
                )
            members = [fcir.broadcast(state["params"]), data, test_data]
            members += [c for c in (counts, test_counts) if c is not None]

            def member(params, data, test, *rest):
                rest = list(rest)
                count = rest.pop(0) if counts is not None else None
                test_count = rest.pop(0) if test_counts is not None else None
                before = algo.measure(params, test, test_count)
                tuned, _, _ = algo.train(params, data, count, steps=k)
                after = algo.measure(tuned, test, test_count)
                return {"before": before, "after": after}, test_spec.weight(test_count)

            metrics, weights = fcir.map_fn(member, tuple(members))
            return _mean(metrics, weights)

        fn.__name__ = fn.__qualname__ = f"{algo.name}_personalized_evaluation"
        fn.__doc__ = f"Personalization evaluation of a {algo.who} state over {n} members."
        return fcir.program(
            placements={"clients": n},
            client_data=("data", "test_data", "counts", "test_counts"),
        )(fn)


def personalized_evaluation(algo: Algorithm, fine_tune_steps: int) -> PersonalizedEvaluation:
    """TFF's personalization evaluation of ``algo``'s state: ``.evaluate(clients=n)``
    is the program (see the module docstring)."""
    return PersonalizedEvaluation(algo, fine_tune_steps)
