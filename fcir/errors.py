"""The errors a user can cause. Every one derives from FcirError.

Messages name the op (and its index or text location) and say what to do; callers
never see a bare KeyError, IndexError or protobuf DecodeError for bad input.
"""

from __future__ import annotations

from fcir.jaxcompat import source_info_util


class FcirError(Exception):
    """Base class of every error fcir raises for bad input."""


class PlacementError(FcirError):
    """A value is used at the wrong placement, or with the wrong cardinality."""


class PrivacyError(PlacementError):
    """In a private program, a value derived from client data reaches the server other
    than through fcir.dp_sum / fcir.dp_mean (see fcir.privacy)."""


class IRTypeError(FcirError):
    """An op's operands or results violate its type rule."""


class ParseError(FcirError):
    """Canonical text (or a serialized Module) could not be read."""


class VersionError(FcirError):
    """A module was written by a newer, incompatible fcir."""


class UnsupportedError(FcirError):
    """A JAX primitive or feature fcir cannot represent or run."""


class ExportError(FcirError):
    """A program cannot be exported to the production cross-device form."""


class CheckpointError(FcirError):
    """A checkpoint is missing, partial, corrupt, or does not match the target."""


class InterpreterError(FcirError):
    """Running a module failed at an op (bad arguments, or an op's runtime condition)."""


class PopulationError(FcirError):
    """A population, its cohorts' sampling, or a simulation over them is malformed."""


class LearningError(FcirError):
    """An ``fcir.learning`` algorithm, aggregator or round got an argument out of its
    range (the message names the argument and the range), or data of the wrong shape."""


# Packages whose frames are never the user's line: fcir (its backends import as
# fcir.interpreters), JAX, and numpy (np.mean(x) of a traced x fails in numpy's code).
_NOT_USER = ("fcir", "jax", "jaxlib", "numpy")


def user_location(error: BaseException) -> str | None:
    """``file.py:12`` of the innermost frame of the user's code in the traceback of
    ``error`` or of the errors it was raised from; None when no frame is the user's.

    Errors raised while a program is traced (fcir's frontend checks, JAX's, the user's
    own TypeError) carry the user's line only in their traceback, which the command
    line does not print; it names the line with this instead."""
    import os
    import traceback

    found = None
    seen: set[int] = set()
    e: BaseException | None = error
    while e is not None and id(e) not in seen:  # outermost first: the last found is deepest
        seen.add(id(e))
        for frame, line in traceback.walk_tb(e.__traceback__):
            if _is_users(frame):
                found = f"{os.path.basename(frame.f_code.co_filename)}:{line}"
        e = e.__cause__ or (None if e.__suppress_context__ else e.__context__)
    return found


def call_site() -> str | None:
    """``file.py:12`` of the innermost frame of the user's code on the current stack
    (the line that called into fcir), or None: a check raised while tracing names the
    line in its message, for callers that print no traceback."""
    import os
    import sys

    frame = sys._getframe(1)
    while frame is not None:
        if _is_users(frame):
            return f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_lineno}"
        frame = frame.f_back
    return None


def _is_users(frame) -> bool:
    """Whether ``frame`` runs the user's code: not fcir's, JAX's, numpy's or another
    installed library's, and not generated code."""
    import os
    import sysconfig


    name = frame.f_code.co_filename
    package = str(frame.f_globals.get("__name__", "")).partition(".")[0]
    libraries = {sysconfig.get_paths()[k] for k in ("purelib", "platlib")}
    return not (
        name.startswith("<")
        or package in _NOT_USER
        or any(name.startswith(lib + os.sep) for lib in libraries)
        or not source_info_util.is_user_filename(name)
    )
