"""Distributed checkpoints: sharded jax arrays saved in parallel without a gather,
committed atomically, restored onto any sharding. See docs/checkpoint.md.

`save`, `restore`, `read_layout` (the fcir.v1.CheckpointLayout protobuf),
`CheckpointManager`, and `SaveHandle` (what an asynchronous `save` returns).
"""

from fcir.checkpoint.layout import read_layout
from fcir.checkpoint.manager import CheckpointManager
from fcir.checkpoint.restoring import restore
from fcir.checkpoint.saving import SaveHandle, save

__all__ = ["CheckpointManager", "SaveHandle", "read_layout", "restore", "save"]
