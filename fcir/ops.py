"""Only what ``interpreters/production/splitting.py`` still imports from here.

The fed ops are ``fcir.fed``'s (``fcir.fed.ops()``, ``fcir.fed.of_kind``). The backend
files of the registry re-keying import ``dtype_bits`` from ``fcir.types`` once merged;
tests/fed/test_op_names.py then fails until this module is deleted.
"""

from fcir.types import dtype_bits

__all__ = ["dtype_bits"]
