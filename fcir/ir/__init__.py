"""The IR: its nodes (``fcir.ir.nodes``), types, attributes, canonical text, protobuf
form, canonical layout and checker.

``from fcir.ir import Module`` (and the other node classes and helpers below) is the
public path to the in-memory IR. Importing this package imports the printer and the
serializer, which ``Module.to_text`` / ``serialize`` / ``deserialize`` call.
"""

from fcir.ir import serialize, text  # install Module's codecs (see nodes.CODECS)
from fcir.ir.nodes import (
    IR_VERSION,
    Func,
    Module,
    Op,
    Region,
    Value,
    check_names,
    check_structure,
    describe,
    expect_module,
    is_name,
    sanitize_name,
    value_numbering,
    walk,
)
