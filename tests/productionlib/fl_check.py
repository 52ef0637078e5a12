"""The real federated_language package's view of Computation bytes (never uses fcir's
own protos, so what it reports is federated_language's reading, not ours).

``summarize(data)`` parses the bytes with federated_language's own computation_pb2 and
builds its building blocks, which checks every intrinsic's concrete type against the
intrinsic's definition and every call's argument against its function's parameter.
Prints the round's type, every intrinsic use and every Xla piece, all in
federated_language's own notation.
"""

import sys
import warnings


def summarize(data: bytes) -> dict:
    from federated_language.compiler import building_blocks
    from federated_language.proto import computation_pb2

    proto = computation_pb2.Computation.FromString(data)
    comp = building_blocks.ComputationBuildingBlock.from_proto(proto)
    intrinsics, xla = [], []

    def visit(node):
        if isinstance(node, building_blocks.Intrinsic):
            intrinsics.append([node.uri, str(node.type_signature)])
        elif isinstance(node, building_blocks.CompiledComputation):
            pb = node.to_proto()
            xla.append(
                {
                    "type": str(node.type_signature),
                    "type_url": pb.xla.hlo_module.type_url,
                    "has_parameter_binding": pb.xla.HasField("parameter"),
                    "has_result_binding": pb.xla.HasField("result"),
                }
            )
        for child in node.children():
            visit(child)

    visit(comp)
    return {
        "kind": type(comp).__name__,
        "type": str(comp.type_signature),
        "intrinsics": intrinsics,
        "xla": xla,
        # federated_language writes back exactly the bytes it read.
        "reserialized_equal": comp.to_proto().SerializeToString(deterministic=True) == data,
    }


def descriptors():
    """Every field of federated_language's computation schema, by message."""
    from federated_language.proto import computation_pb2

    out = {}

    def visit(desc, prefix):
        name = prefix + desc.name
        for f in desc.fields:
            out[f"{name}.{f.number}"] = [f.name, f.type, f.label, f.containing_oneof is not None]
        for nested in desc.nested_types:
            visit(nested, name + ".")

    with warnings.catch_warnings():  # FieldDescriptor.label is deprecated in protobuf 6
        warnings.simplefilter("ignore", DeprecationWarning)
        for desc in computation_pb2.DESCRIPTOR.message_types_by_name.values():
            visit(desc, "")
        array = sys.modules["federated_language.proto.array_pb2"]
        for desc in array.DESCRIPTOR.message_types_by_name.values():
            visit(desc, "")
    return out

