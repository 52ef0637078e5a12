"""fcir: a compiler and interpreter toolkit for federated computations written in JAX."""

from fcir import fed as _fed  # every fed op's module: its primitive and JAX rules
from fcir import privacy
from fcir.base_interpreter import Interpreter, impl
from fcir.checker.check import check, verify
from fcir.errors import (
    CheckpointError,
    ExportError,
    FcirError,
    InterpreterError,
    IRTypeError,
    LearningError,
    ParseError,
    PlacementError,
    PopulationError,
    PrivacyError,
    UnsupportedError,
    VersionError,
)
from fcir.frontend.capture import capture
from fcir.frontend.evaluation import evaluation
from fcir.ir import IR_VERSION, Module
from fcir.ir.text import parse
from fcir.opkit.placement import program
from fcir.population import Cohorts, Population
from fcir.version import __version__

# The user-facing functions the fed op modules define (``@fcir.fed.public``:
# ``fcir.broadcast``, ``fcir.map_fn``, ``fcir.reduce_sum``, ``fcir.dp_mean``, ...), read
# from the registry: each is defined in its op's module and named nowhere else.
globals().update(_fed.FUNCTIONS)

