"""fcir: a compiler and interpreter toolkit for federated computations written in JAX."""

from fcir import autodiff as _autodiff  # noqa: F401  (registers AD rules)
from fcir import privacy
from fcir.api import (
    broadcast,
    dp_mean,
    dp_sum,
    map_fn,
    program,
    reduce_max,
    reduce_mean,
    reduce_min,
    reduce_sum,
    reduce_weighted_mean,
    secure_sum,
)
from fcir.capture import capture
from fcir.check import check, verify
from fcir.ddp_api import ddp_mean, ddp_sum
from fcir.errors import (
    CheckpointError,
    ExportError,
    FcirError,
    InterpreterError,
    IRTypeError,
    ParseError,
    PlacementError,
    PrivacyError,
    UnsupportedError,
    VersionError,
)
from fcir.fed import reduce_median, reduce_trimmed_mean
from fcir.interpreter import Interpreter, impl
from fcir.ir import IR_VERSION, Module
from fcir.text import parse

__version__ = "0.1.0"
