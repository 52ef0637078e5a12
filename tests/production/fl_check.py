"""Runs inside the federated_language virtual environment (never imports fcir).

    python fl_check.py ROUND.computation.pb [...]

For each file: parses the bytes with federated_language's own computation_pb2, builds
its building blocks (which checks every intrinsic's concrete type against the
intrinsic's definition and every call's argument type against its function), and
prints one JSON object per file: the round's type, every intrinsic use with its type,
and every Xla piece's type, all in federated_language's own notation.
"""

import json
import sys


def summarize(path):
    from federated_language.compiler import building_blocks
    from federated_language.proto import computation_pb2

    with open(path, "rb") as f:
        proto = computation_pb2.Computation.FromString(f.read())
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
        "file": path,
        "kind": type(comp).__name__,
        "type": str(comp.type_signature),
        "intrinsics": intrinsics,
        "xla": xla,
        # Round trip: federated_language writes back the bytes it read.
        "roundtrip_equal": comp.to_proto() == proto,
    }


def main(argv):
    for path in argv:
        print(json.dumps(summarize(path)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
