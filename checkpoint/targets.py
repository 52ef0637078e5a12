"""What a restore target leaf may ask for, checked against what is saved.

One set of rules for both formats (fcir's own and Orbax's), so a target that fcir
refuses for one is refused for the other with the same message: shapes must match,
dtypes must match unless `cast=True`, Python scalars need a saved value of their kind,
and typed PRNG keys restore only into key targets (their key data is what is stored).
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from fcir.errors import CheckpointError


def is_key_dtype(dtype: Any) -> bool:
    try:
        return bool(jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key))
    except TypeError:
        return False


def check_shape(name: str, shape: tuple[int, ...], saved: tuple[int, ...]) -> None:
    if shape != saved:
        raise CheckpointError(
            f"array {name!r}: target shape {shape} but the checkpoint has {saved}"
        )


def check_dtype(name: str, dtype: Any, saved: np.dtype, cast: bool) -> np.dtype:
    """The target's numpy dtype, once it may hold the saved one; else a CheckpointError."""
    if is_key_dtype(dtype):
        # numpy has no key dtypes (np.dtype(key<fry>) is a TypeError), and plain data
        # (e.g. raw uint32 keys from jax.random.PRNGKey) carries no implementation.
        raise CheckpointError(
            f"array {name!r}: target dtype {dtype} is PRNG keys but the checkpoint holds "
            f"plain {saved.name} data; restore it as {saved.name} and wrap it with "
            "jax.random.wrap_key_data"
        )
    dtype = np.dtype(dtype)
    # A silent conversion would hide a mismatched target (a bfloat16 model restored from
    # float32 loses precision, float into int truncates), so it has to be asked for.
    if not cast and dtype != saved:
        raise CheckpointError(
            f"array {name!r}: target dtype {dtype.name} but the checkpoint has "
            f"{saved.name}; pass cast=True to restore to convert it"
        )
    return dtype


# A Python scalar target holds any saved value of its kind: an int any integer width, a
# float float32 or float64 exactly. A bool is an int, so it is looked up first.
_SCALAR_KINDS = ((bool, "b"), (int, "iu"), (float, "f"), (complex, "c"))


def check_scalar_kind(name: str, leaf: Any, saved: np.dtype, cast: bool) -> None:
    kinds = next(k for t, k in _SCALAR_KINDS if isinstance(leaf, t))
    if not cast and saved.kind not in kinds:
        raise CheckpointError(
            f"array {name!r}: target is a Python {type(leaf).__name__} but the checkpoint "
            f"has {saved.name}; pass cast=True to restore to convert it"
        )


def key_layout(name: str, impl: str, data_shape: tuple[int, ...]) -> tuple[tuple[int, ...], Any]:
    """The shape of the keys whose key data (of `impl`) has `data_shape`, and their dtype."""
    try:
        dtype = jax.eval_shape(lambda: jax.random.key(0, impl=impl)).dtype
        key_shape = tuple(
            jax.eval_shape(lambda: jax.random.key_data(jax.random.key(0, impl=impl))).shape
        )
    except (ValueError, TypeError, KeyError) as e:
        raise CheckpointError(
            f"array {name!r}: PRNG implementation {impl!r} is unknown to this jax"
        ) from e
    if data_shape[len(data_shape) - len(key_shape) :] != key_shape:
        raise CheckpointError(f"array {name!r}: key data of shape {data_shape} do not fit {impl!r}")
    return data_shape[: len(data_shape) - len(key_shape)], dtype


def key_data_sharding(
    name: str, leaf: Any, impl: str, data_shape: tuple[int, ...], data_dtype: np.dtype
) -> jax.sharding.Sharding:
    """Where the key data go so that wrapping them gives keys in the target's sharding.

    The key data have the keys' dimensions plus the implementation's trailing ones,
    which every device holds whole. A target of the key data's own shape and dtype
    (what `orbax.checkpoint.utils.to_shape_dtype_struct` makes of typed keys) is
    placed as it says, and the keys come back typed, as Orbax restores them.
    """
    keys_shape, key_dtype = key_layout(name, impl, data_shape)
    trailing = len(data_shape) - len(keys_shape)
    if (
        isinstance(leaf, (jax.ShapeDtypeStruct, jax.Array))
        and not is_key_dtype(leaf.dtype)
        and tuple(leaf.shape) == data_shape
        and np.dtype(leaf.dtype) == data_dtype
    ):
        return getattr(leaf, "sharding", None) or jax.sharding.SingleDeviceSharding(
            jax.local_devices()[0]
        )
    if isinstance(leaf, jax.sharding.Sharding):
        sharding = leaf
    elif isinstance(leaf, (jax.ShapeDtypeStruct, jax.Array)):
        check_shape(name, tuple(leaf.shape), keys_shape)
        if leaf.dtype != key_dtype:
            raise CheckpointError(
                f"array {name!r}: target dtype {leaf.dtype} but the checkpoint holds PRNG keys "
                f"{key_dtype} ({impl})"
            )
        sharding = getattr(leaf, "sharding", None) or jax.sharding.SingleDeviceSharding(
            jax.local_devices()[0]
        )
    else:
        raise CheckpointError(
            f"array {name!r} holds PRNG keys ({impl}); restore them into a "
            "jax.ShapeDtypeStruct of their key dtype, a key jax.Array or a Sharding"
        )
    if isinstance(sharding, jax.sharding.NamedSharding):
        spec = (*sharding.spec, *([None] * (len(keys_shape) - len(sharding.spec))))
        return jax.sharding.NamedSharding(
            sharding.mesh, jax.sharding.PartitionSpec(*spec, *([None] * trailing))
        )
    if isinstance(sharding, jax.sharding.SingleDeviceSharding):
        return sharding
    raise CheckpointError(
        f"array {name!r}: PRNG keys restore onto a NamedSharding or a single device, "
        f"not {type(sharding).__name__}"
    )
