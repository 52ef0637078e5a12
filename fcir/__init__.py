"""fcir: a compiler and interpreter toolkit for federated computations written in JAX."""

from fcir import fed as _fed  # every fed op's module: its primitive and JAX rules
from fcir import privacy
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
from fcir.frontend.capture import capture
from fcir.frontend.ddp_functions import ddp_mean, ddp_sum
from fcir.frontend.program import (
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
from fcir.interpreter import Interpreter, impl
from fcir.ir import IR_VERSION, Module
from fcir.ir.check import check, verify
from fcir.ir.text import parse
from fcir.version import __version__

# The user-facing functions the fed op modules define (``@fcir.fed.public``:
# ``fcir.reduce_median``, ...), read from the registry.
globals().update(_fed.FUNCTIONS)

