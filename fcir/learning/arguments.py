"""The checks every ``fcir.learning`` constructor runs on its arguments.

An argument out of range is a :class:`fcir.LearningError` naming the function, the
argument, the allowed range and the value given, when the algorithm is built: never
later as a NaN in the third round or a JAX error from inside a trace.
"""

from __future__ import annotations

import math
import numbers

import optax

from fcir.errors import LearningError

__all__ = ["callable_", "count", "number", "optimizer"]


def number(
    who: str,
    name: str,
    value,
    *,
    low: float | None = None,
    high: float | None = None,
    low_open: bool = False,
    high_open: bool = False,
) -> float:
    """``value`` as a float within ``[low, high]`` (``(`` / ``)`` where open)."""
    ok = isinstance(value, numbers.Real) and not isinstance(value, bool)
    if ok:
        v = float(value)
        ok = math.isfinite(v)
        if ok and low is not None:
            ok = v > low if low_open else v >= low
        if ok and high is not None:
            ok = v < high if high_open else v <= high
    if not ok:
        raise LearningError(
            f"{who}: {name} must be a finite number {_range(low, high, low_open, high_open)}, "
            f"got {value!r}"
        )
    return float(value)


def _range(low, high, low_open, high_open) -> str:
    if low is not None and high is not None:
        return f"in {'(' if low_open else '['}{low:g}, {high:g}{')' if high_open else ']'}"
    if low is not None:
        return f"{'>' if low_open else '>='} {low:g}"
    if high is not None:
        return f"{'<' if high_open else '<='} {high:g}"
    return ""


def count(who: str, name: str, value, low: int, high: int | None = None, why: str = "") -> int:
    """``value`` as an int within ``[low, high]``; ``why`` explains the bound."""
    ok = isinstance(value, numbers.Integral) and not isinstance(value, bool)
    if not ok or value < low or (high is not None and value > high):
        bound = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise LearningError(f"{who}: {name} must be an int {bound}{why}, got {value!r}")
    return int(value)


def optimizer(who: str, name: str, value) -> optax.GradientTransformation:
    """An optax optimizer (``optax.sgd(0.1)``, ``optax.adam(...)``, a chain)."""
    if not isinstance(value, optax.GradientTransformation):
        example = "optax.sgd(0.1)" if name.startswith("client") else "optax.adam(1e-2)"
        raise LearningError(
            f"{who}: {name} must be an optax optimizer (an optax.GradientTransformation, "
            f"e.g. {example}), got {type(value).__name__}"
        )
    return value


def callable_(who: str, name: str, value, what: str):
    if not callable(value):
        raise LearningError(f"{who}: {name} must be {what}, got {type(value).__name__}")
    return value
