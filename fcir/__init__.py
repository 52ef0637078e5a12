"""fcir: a compiler and interpreter toolkit for federated computations written in JAX."""

from fcir import fed as _fed  # every fed op's module: its primitive and JAX rules
from fcir import privacy
from fcir.api import program
from fcir.capture import capture
from fcir.check import check, verify
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
from fcir.interpreter import Interpreter, impl
from fcir.ir import IR_VERSION, Module
from fcir.text import parse

# The user-facing functions the fed op modules define (``@fcir.fed.public``:
# ``fcir.broadcast``, ``fcir.map_fn``, ``fcir.reduce_sum``, ``fcir.dp_mean``, ...), read
# from the registry: each is defined in its op's module and named nowhere else.
globals().update(_fed.FUNCTIONS)

__version__ = "0.1.0"
