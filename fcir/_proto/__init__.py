"""Generated protobuf modules (python tools/gen_protos.py); never edit by hand."""
