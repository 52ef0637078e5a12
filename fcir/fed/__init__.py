"""The federated ops, one module each, and the registry every list of them comes from.

Importing this package imports every module in it (``pkgutil``: a new op's module
needs no import line anywhere) and so defines every fed op (``fcir.fed.base.FedOp``
subclasses register themselves). ``ops()`` is name -> class; ``of_kind("reduction",
"dp")`` the names of the ops of some kinds; ``by_primitive()`` JAX primitive name ->
class; ``FUNCTIONS`` the user-facing functions the op modules mark ``@public``
(``fcir`` exports them). Each op class is also an attribute here (``fcir.fed.Sum``).
docs/adding_an_op.md says what a new op's module holds and which backend tables take
an entry for it.
"""

from __future__ import annotations

import importlib
import pkgutil

from . import base
from .base import (
    FUNCTIONS,
    KINDS,
    Context,
    FedOp,
    Reduction,
    Unsupported,
    Violation,
    by_primitive,
    of_kind,
    op_class,
    ops,
    public,
    resolve,
)

for _info in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
    if _info.name != "base":
        importlib.import_module(f"{__name__}.{_info.name}")

_CLASSES = {cls.__name__: cls for cls in FedOp.registry.values()}
globals().update(_CLASSES)
# A function named as its op's module (``broadcast``, ``dp_sum``) leaves the module in
# place (``fcir.fed.dp_sum.dp_jvp``): ``fcir.dp_sum`` and ``FUNCTIONS`` name the function.
_FUNCTIONS = {k: f for k, f in FUNCTIONS.items() if k not in globals()}
globals().update(_FUNCTIONS)

__all__ = sorted(
    [
        "FUNCTIONS",
        "KINDS",
        "Context",
        "FedOp",
        "Reduction",
        "Unsupported",
        "Violation",
        "base",
        "by_primitive",
        "of_kind",
        "op_class",
        "ops",
        "public",
        "resolve",
        *_CLASSES,
        *_FUNCTIONS,
    ]
)
