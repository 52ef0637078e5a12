"""Distributed checkpoints: sharded jax arrays saved in parallel, committed atomically,
restored onto any sharding. See docs/checkpoint.md.

    from fcir import checkpoint
    checkpoint.save(path, {"params": params, "step": 10})
    handle = checkpoint.save(path, tree, blocking=False); handle.wait()
    tree = checkpoint.restore(path, target={"params": abstract_params})
    layout = checkpoint.read_layout(path)     # the fcir.v1.CheckpointLayout protobuf
"""

from fcir.checkpoint.layout import read_layout
from fcir.checkpoint.manager import CheckpointManager
from fcir.checkpoint.restoring import restore
from fcir.checkpoint.saving import SaveHandle, save

__all__ = ["CheckpointManager", "SaveHandle", "read_layout", "restore", "save"]
