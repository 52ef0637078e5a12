"""The algorithm object every ``fcir.learning`` module builds.

``algo.init(params)`` is the server state, a dict of arrays (checkpoint it as it is:
``params``, ``round``, the algorithm's own entries, the aggregator's under
``aggregator``); ``algo.round(clients=n)`` is an ``@fcir.program``::

    rnd(state, data, counts=None, key=None) -> (state, metrics)

``data`` is a pytree whose leaves are ``[clients, local_steps, batch, ...]``: member
``i`` takes one ``client_optimizer`` step per entry of its ``local_steps`` axis.
``counts`` (``f32[clients]``, what ``fcir.Population`` pads and ``xla.simulate``
passes) is each member's number of real entries of that axis: the steps past it are
skipped, and the member's update and metrics weigh ``counts * batch`` examples; a
member with count 0 (a Poisson cohort's padding) trains nothing and weighs nothing.
Without counts every member trains every step and all weigh alike. ``key`` is the
PRNG key a DP aggregator draws from (``xla.simulate(..., key=)`` passes
``fold_in(key, r)``), or one key per client for ``learning.ddp``; the round folds
its round number in, so a key fed again every round (a Flower app's input) still
draws fresh noise.

``metrics`` is ``{"loss": ..., **aux}``: the members' mean training loss (and the
scalars ``loss_fn`` returns beside it as ``(loss, {name: value})``), weighted like the
update. A private round (a DP aggregator) reports no training metrics: they would
reach the server without noise.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax

import fcir
from fcir.errors import LearningError

from . import arguments
from .aggregators import Aggregator, mean

__all__ = ["Algorithm"]


class Algorithm:
    """A federated learning algorithm: ``init`` / ``round`` / ``params`` / ``evaluate``.

    A subclass names itself (``name``), says what its members send (``client``), and
    how the server moves its state (``update``); the base class holds the round's
    skeleton: broadcast, the members' work in one ``fcir.map_fn``, the aggregator,
    the metrics."""

    name = "algorithm"
    # What the members' main value is: their trained "model" (the aggregator combines
    # models, or updates when it is relative) or a "gradient".
    sends = "model"
    # Entries of the state besides params, round and aggregator (init makes them).
    state_keys: tuple[str, ...] = ()
    # Client outputs averaged like the metrics, beside the aggregated value.
    averaged: tuple[str, ...] = ()
    # The state entry holding values kept at the clients (one per member), if any.
    client_state: str | None = None
    # Whether the members train locally (FedSGD's send a gradient instead).
    local_training = True

    def __init__(self, loss_fn, client_optimizer, aggregator):
        self.who = f"learning.{self.name}"
        self.loss_fn = arguments.callable_(
            self.who, "loss_fn", loss_fn, "a function loss_fn(params, batch) -> scalar"
        )
        if not self.local_training:
            self.client_optimizer = None
        elif client_optimizer is None:
            raise LearningError(
                f"{self.who}: client_optimizer is required: an optax optimizer for the "
                "clients' local steps, e.g. client_optimizer=optax.sgd(0.1)"
            )
        else:
            self.client_optimizer = arguments.optimizer(
                self.who, "client_optimizer", client_optimizer
            )
        aggregator = mean() if aggregator is None else aggregator
        if not isinstance(aggregator, Aggregator):
            raise LearningError(
                f"{self.who}: aggregator must be one of fcir.learning's aggregators "
                "(learning.median(), learning.krum(f), learning.dp(clip_norm, z), ...), "
                f"got {type(aggregator).__name__}"
            )
        self.aggregator = aggregator

    def __repr__(self) -> str:
        return f"<{self.who} aggregator={self.aggregator!r}>"

    # --- the state ----------------------------------------------------------------------

    def init(self, params) -> dict:
        """The server state before round 1: ``{"params", "round", ...}``."""
        params = _float_params(self.who, params)
        state = {"params": params, "round": jnp.zeros((), jnp.int32)}
        state.update(self.server_state(params))
        extra = self.aggregator.init(params)
        if extra is not None:
            state["aggregator"] = extra
        return state

    def server_state(self, params) -> dict:
        """The algorithm's own state entries (``state_keys``), at their initial values."""
        del params
        return {}

    def params(self, state):
        """The model parameters in ``state``."""
        self._check_state(state)
        return state["params"]

    def _check_state(self, state) -> None:
        want = {"params", "round", *self.state_keys}
        if type(self.aggregator).init is not Aggregator.init:
            want.add("aggregator")
        if self.client_state is not None:
            want.add(self.client_state)
        missing = sorted(want - set(state)) if isinstance(state, dict) else sorted(want)
        if missing:
            raise LearningError(
                f"{self.who}: the state has no {', '.join(map(repr, missing))}: make it with "
                f"algo.init(params) (a {self.name} state holds {sorted(want)})"
            )

    # --- the round ----------------------------------------------------------------------

    def validate(self, clients: int) -> None:
        """Raises LearningError when a round of ``clients`` members cannot run."""
        self.aggregator.validate(self.who, clients)

    def round(self, clients: int):
        """The round as an ``@fcir.program`` over ``clients`` members:
        ``(state, data, counts=None, key=None) -> (state, metrics)``."""
        n = arguments.count(f"{self.who}(...).round", "clients", clients, 1)
        self.validate(n)

        def fn(state, data, counts=None, key=None):
            return self._round(n, state, data, counts, key)

        fn.__name__ = fn.__qualname__ = f"{self.name}_round"
        fn.__doc__ = f"One round of {self.who} over {n} members."
        client_data = None
        if self.client_state is None:
            client_data = ("data", "counts", *(("key",) if self.aggregator.client_keys else ()))
        return fcir.program(
            placements={"clients": n}, private=self.aggregator.private, client_data=client_data
        )(fn)

    def _round(self, n, state, data, counts, key):
        self._check_state(state)
        spec = DataSpec.of(self.who, data, counts, n)
        t = state["round"]
        key = self._round_key(key, t)
        sent = fcir.broadcast(self.sent(state))
        members = [sent, data]
        if self.client_state is not None:
            members.append(self._client_state(state, n))
        if counts is not None:
            members.append(counts)

        def member(sent, data, *rest):
            cstate = rest[0] if self.client_state is not None else None
            count = rest[-1] if counts is not None else None
            out = self.client(sent, cstate, data, count, spec)
            return out, spec.weight(count)

        outs, weights = fcir.map_fn(member, tuple(members))
        return self._server(state, outs, weights, key, t, n)

    def _client_state(self, state, n: int):
        held = state[self.client_state]
        shapes = [tuple(np.shape(x)) for x in jax.tree.leaves(held)]
        if not shapes or any(not s or s[0] != n for s in shapes):
            raise LearningError(
                f"{self.who}: state[{self.client_state!r}] holds one value per member, a "
                f"leading axis of {n} (the round's clients): make the state with "
                f"algo.init(params, clients={n}); got shapes {shapes}"
            )
        return held

    def _server(self, state, outs, weights, key, t, n):
        agg = self.aggregator
        value, agg_state, agg_metrics = agg(
            outs["value"], weights if agg.uses_weights else None, state.get("aggregator"), key
        )
        if self.sends == "model" and agg.relative:
            value = jax.tree.map(lambda p, d: p + d.astype(p.dtype), state["params"], value)
        means = {k: _mean(outs[k], weights) for k in self.averaged}
        new = self.update(state, value, means, n)
        new["round"] = t + 1
        if agg_state is not None:
            new["aggregator"] = agg_state
        if self.client_state is not None:
            new[self.client_state] = outs["client_state"]
        metrics = {} if agg.private else _mean(outs["metrics"], weights)
        return new, {**metrics, **agg_metrics}

    def _round_key(self, key, t):
        agg = self.aggregator
        if not agg.private:
            return None
        if key is None:
            kind = "one PRNG key per client (client data)" if agg.client_keys else "a PRNG key"
            raise LearningError(
                f"{self.who} with {agg!r}: a private round draws noise and needs {kind}: "
                "rnd(state, data, counts, key) (xla.simulate(..., key=k) passes one)"
            )
        if agg.client_keys:
            at = fcir.broadcast(t)
            return fcir.map_fn(lambda k, t: jax.random.fold_in(k, t), (key, at))
        return jax.random.fold_in(key, t)

    def sent(self, state):
        """What the server broadcasts each round: the model (SCAFFOLD adds its control)."""
        return state["params"]

    def client(self, sent, cstate, data, count, spec) -> dict:
        """One member's work: ``{"value", "metrics", ...}`` (values are what it sends;
        ``client_state``: its new state). The default trains locally and sends its
        model (or its update, for a relative aggregator)."""
        trained, metrics, _ = self.train(sent, data, count)
        return {"value": self.to_send(trained, sent), "metrics": metrics}

    def to_send(self, trained, sent_params):
        """The trained model, or its difference from the model sent when the aggregator
        combines updates (DP clips the update, not the model)."""
        if self.aggregator.relative:
            return jax.tree.map(jnp.subtract, trained, sent_params)
        return trained

    def update(self, state, model, means, members: int) -> dict:
        """The new state (round and aggregator entries aside) from the aggregated
        ``model`` (or gradient) and the ``averaged`` client outputs of the round's
        ``members``."""
        raise NotImplementedError

    # --- the members' local work --------------------------------------------------------

    def losses(self, params, batch):
        """``(loss, aux)`` of ``loss_fn`` on one batch; aux a dict of scalars."""
        out = self.loss_fn(params, batch)
        loss, aux = out if isinstance(out, tuple) else (out, {})
        if not isinstance(aux, dict) or any(np.shape(v) != () for v in aux.values()):
            raise LearningError(
                f"{self.who}: loss_fn must return a scalar, or (scalar, {{name: scalar}}) "
                f"for metrics beside the loss; got aux {jax.tree.map(np.shape, aux)}"
            )
        if np.shape(loss) != ():
            raise LearningError(
                f"{self.who}: loss_fn must return a scalar loss, got shape {np.shape(loss)}"
            )
        if "loss" in aux:
            raise LearningError(f"{self.who}: loss_fn's metrics may not be named 'loss'")
        return loss, aux

    def train(self, params, data, count, *, penalty=None, correction=None, steps=None,
              gradient=False):  # fmt: skip
        """Local training from ``params``: one ``client_optimizer`` step per entry of
        ``data``'s leading axis (the first ``steps`` entries, when given), skipping the
        entries at or past ``count``. Returns ``(params, metrics, mean gradient)``:
        metrics the mean loss and aux over the steps taken; with ``gradient=True`` the
        mean gradient of ``loss_fn`` along the way (SCAFFOLD's new control), else None.
        ``penalty(p)`` is added to the objective (FedProx), ``correction`` to each
        gradient (SCAFFOLD)."""
        if steps is not None:
            data = jax.tree.map(lambda x: x[:steps], data)
        opt = self.client_optimizer
        n = jax.tree.leaves(data)[0].shape[0]

        def objective(p, batch):
            loss, aux = self.losses(p, batch)
            total = loss if penalty is None else loss + penalty(p)
            return total, (loss, aux)

        def step(carry, xs):
            p, s, gsum = carry
            batch, i = xs if count is not None else (xs, None)
            (_, (loss, aux)), g = jax.value_and_grad(objective, has_aux=True)(p, batch)
            raw = g
            if correction is not None:
                g = jax.tree.map(lambda a, b: a + b.astype(a.dtype), g, correction)
            upd, s2 = opt.update(g, s, p)
            p2 = optax.apply_updates(p, upd)
            live = None if count is None else i < count
            if live is not None:
                p2, s2 = _where(live, (p2, s2), (p, s))
            if gradient:
                if live is not None:
                    raw = jax.tree.map(lambda x: jnp.where(live, x, jnp.zeros_like(x)), raw)
                gsum = jax.tree.map(jnp.add, gsum, raw)
            return (p2, s2, gsum), {"loss": loss, **aux}

        zeros = jax.tree.map(jnp.zeros_like, params) if gradient else None
        (trained, _, gsum), per_step = jax.lax.scan(
            step, (params, opt.init(params), zeros), _indexed(data, count, n)
        )
        mean_gradient = _tree_div(gsum, count, n) if gradient else None
        return trained, _step_mean(per_step, count, n), mean_gradient

    def measure(self, params, data, count):
        """The mean loss (and aux) of ``params`` over a member's batches, no training."""
        n = jax.tree.leaves(data)[0].shape[0]

        def one(_, batch):
            loss, aux = self.losses(params, batch)
            return None, {"loss": loss, **aux}

        _, per_step = jax.lax.scan(one, None, data)
        return _step_mean(per_step, count, n)

    def mean_gradient(self, params, data, count):
        """The mean gradient of ``loss_fn`` at ``params`` over a member's batches (and
        the metrics there): FedSGD's member value."""
        n = jax.tree.leaves(data)[0].shape[0]

        def one(gsum, xs):
            batch, i = xs if count is not None else (xs, None)
            (loss, aux), g = jax.value_and_grad(self.losses, has_aux=True)(params, batch)
            if count is not None:
                g = jax.tree.map(lambda x: jnp.where(i < count, x, jnp.zeros_like(x)), g)
            return jax.tree.map(jnp.add, gsum, g), {"loss": loss, **aux}

        zeros = jax.tree.map(jnp.zeros_like, params)
        gsum, per_step = jax.lax.scan(one, zeros, _indexed(data, count, n))
        return _tree_div(gsum, count, n), _step_mean(per_step, count, n)

    # --- evaluation ---------------------------------------------------------------------

    def evaluate(self, clients: int):
        """Federated evaluation as an ``@fcir.program`` over ``clients`` members:
        ``(state, data, counts=None) -> {"loss": ..., **aux}``, each member's mean over
        its batches (the real ones) at the state's model, weighted by examples as the
        round weighs them (Flower's evaluate stage, TFF's federated evaluation)."""
        n = arguments.count(f"{self.who}(...).evaluate", "clients", clients, 1)

        def fn(state, data, counts=None):
            self._check_state(state)
            spec = DataSpec.of(self.who, data, counts, n)
            members = (
                fcir.broadcast(state["params"]),
                data,
                *(() if counts is None else (counts,)),
            )

            def member(params, data, count=None):
                return self.measure(params, data, count), spec.weight(count)

            metrics, weights = fcir.map_fn(member, members)
            return _mean(metrics, weights)

        fn.__name__ = fn.__qualname__ = f"{self.name}_evaluation"
        fn.__doc__ = f"Federated evaluation of a {self.who} state over {n} members."
        return fcir.program(placements={"clients": n}, client_data=("data", "counts"))(fn)


@dataclasses.dataclass(frozen=True)
class DataSpec:
    """The shape of a round's data: ``steps`` entries of ``batch`` examples a member."""

    steps: int
    batch: int

    @classmethod
    def of(cls, who: str, data, counts, n: int) -> DataSpec:
        leaves = jax.tree.leaves(data)
        shapes = [tuple(np.shape(x)) for x in leaves]
        bad = not leaves or any(len(s) < 2 or s[:2] != shapes[0][:2] for s in shapes)
        if bad or shapes[0][0] != n:
            raise LearningError(
                f"{who}: data must be a pytree of arrays [clients={n}, local_steps, batch, "
                f"...], one local-steps axis for all; got shapes {shapes}"
            )
        if counts is not None and tuple(np.shape(counts)) != (n,):
            raise LearningError(
                f"{who}: counts must be f32[{n}], each member's number of real local "
                f"steps (fcir.Population's counts), got shape {tuple(np.shape(counts))}"
            )
        batch = shapes[0][2] if len(shapes[0]) > 2 else 1
        return cls(shapes[0][1], batch)

    def weight(self, count):
        """A member's weight: its examples, ``count * batch``; None without counts."""
        return None if count is None else count.astype(jnp.float32) * self.batch


def _float_params(who: str, params):
    leaves = jax.tree.leaves(params)
    if not leaves:
        raise LearningError(f"{who}: params has no arrays")
    for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        if not jnp.issubdtype(jnp.result_type(leaf), jnp.floating):
            raise LearningError(
                f"{who}: params{jax.tree_util.keystr(path)} is {jnp.result_type(leaf)}; "
                "every parameter must be a floating-point array"
            )
    return jax.tree.map(jnp.asarray, params)


def _indexed(data, count, n: int):
    """What a scan over a member's steps walks: the batches, with each step's index
    when a count masks the steps past it."""
    return data if count is None else (data, jnp.arange(n))


def _where(live, new, old):
    return jax.tree.map(lambda a, b: jnp.where(live, a, b), new, old)


def _step_mean(per_step: dict, count, n: int) -> dict:
    """The mean over the steps taken (all ``n``, or the first ``count``)."""
    if count is None:
        return {k: jnp.mean(v.astype(jnp.float32)) for k, v in per_step.items()}
    live = jnp.arange(n) < count
    taken = jnp.maximum(jnp.minimum(count.astype(jnp.float32), n), 1.0)
    # where, not a product: a padded step's loss may be anything, NaN included.
    return {
        k: jnp.sum(jnp.where(live, v.astype(jnp.float32), 0.0)) / taken for k, v in per_step.items()
    }


def _tree_div(tree, count, n: int):
    if count is None:
        return jax.tree.map(lambda x: x / n, tree)
    taken = jnp.maximum(jnp.minimum(count.astype(jnp.float32), n), 1.0)
    return jax.tree.map(lambda x: x / taken.astype(x.dtype), tree)


def _mean(values, weights):
    if weights is None:
        return fcir.reduce_mean(values)
    return fcir.reduce_weighted_mean(values, weights)
