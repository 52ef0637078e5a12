"""The errors a user can cause. Every one derives from FcirError.

Messages name the op (and its index or text location) and say what to do; callers
never see a bare KeyError, IndexError or protobuf DecodeError for bad input.
"""

from __future__ import annotations


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
