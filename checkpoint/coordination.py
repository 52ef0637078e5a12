"""Messages between the processes of one save, through jax's distributed key-value store.

Saves run their commit protocol on a background thread, so they must not use device
collectives (which would interleave with training steps); the coordination service's
key-value store is host-only and thread-safe. Every process numbers its saves in call
order, and all processes must call save in the same order, so `(save number, name)`
keys agree across processes.
"""

from __future__ import annotations

import threading

import jax

from fcir.errors import CheckpointError
from fcir.jaxcompat import distributed_client

#: How long a process waits for the others at one step of a save.
TIMEOUT_S = 3600.0


class Coordinator:
    """Publishes and fetches short strings under keys shared by all processes."""

    def __init__(self) -> None:
        self.process_index = jax.process_index()
        self.process_count = jax.process_count()
        self._local: dict[str, str] = {}
        self._changed = threading.Condition()
        self._client = None
        if self.process_count > 1:

            self._client = distributed_client()
            if self._client is None:
                raise CheckpointError(
                    "several jax processes but no jax.distributed client; "
                    "call jax.distributed.initialize() first"
                )

    def publish(self, key: str, value: str) -> None:
        if self._client is not None:
            self._client.key_value_set(key, value)
            return
        with self._changed:
            self._local[key] = value
            self._changed.notify_all()

    def fetch(self, key: str, timeout_s: float = TIMEOUT_S) -> str:
        if self._client is not None:
            try:
                return self._client.blocking_key_value_get(key, int(timeout_s * 1000))
            except Exception as e:  # the client raises XlaRuntimeError on timeout
                raise CheckpointError(
                    f"gave up waiting for the other processes of the save ({key}): {e}"
                ) from e
        with self._changed:
            if not self._changed.wait_for(lambda: key in self._local, timeout_s):
                raise CheckpointError(f"gave up waiting for {key}")
            return self._local.pop(key)
