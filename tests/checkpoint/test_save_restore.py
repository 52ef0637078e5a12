"""Round trips: what is saved comes back bit-exactly, in the target's sharding or as numpy."""

from __future__ import annotations

import collections
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from ckpt_testing import mapped_from, same_bits, values
from fcir.checkpoint import reader
from jax.sharding import NamedSharding, SingleDeviceSharding
from jax.sharding import PartitionSpec as P

from fcir import checkpoint
from fcir._proto import checkpoint_pb2 as pb
from fcir.errors import CheckpointError

Pair = collections.namedtuple("Pair", ["mu", "nu"])


def put(x: np.ndarray, sharding: jax.sharding.Sharding) -> jax.Array:
    return jax.device_put(x, sharding)


@pytest.fixture
def mesh8(devices):
    return jax.make_mesh((8,), ("x",), devices=devices)


@pytest.fixture
def mesh24(devices):
    return jax.make_mesh((2, 4), ("a", "b"), devices=devices)


@pytest.fixture
def tree(mesh8, mesh24):
    """A training-state-like tree with every kind of leaf, and its numpy expectation."""
    w = values((64, 48), seed=1)
    b = values((48,), seed=2)
    m = values((16, 8, 4), "bfloat16", seed=3)
    e = values((8, 0), seed=4)
    k = values((32, 16), "int32", seed=5)
    saved = {
        "params": {
            "w": put(w, NamedSharding(mesh8, P("x"))),
            "b": put(b, NamedSharding(mesh8, P())),
            "layers": [
                put(m, NamedSharding(mesh24, P("b", None, "a"))),
                put(e, NamedSharding(mesh8, P())),
            ],
        },
        "opt_state": (
            Pair(mu=put(k, NamedSharding(mesh24, P("a", "b"))), nu=np.arange(6.0)),
            None,
            {"count": jnp.int32(7), "lr": 0.5, "flag": True, "np_scalar": np.float32(2.5)},
        ),
        "step": 12,
        "meta": {"name": "run-1", "tags": ["a", "b"], "ratio": 0.25, "none": None},
        "single": put(values((5, 3), seed=6), SingleDeviceSharding(jax.devices()[3])),
    }
    return saved


def test_round_trip_without_target_gives_host_numpy(tmp_path, tree):
    checkpoint.save(tmp_path / "c", tree)
    out = checkpoint.restore(tmp_path / "c")
    assert list(out) == list(tree)
    p = out["params"]
    assert isinstance(p["w"], np.ndarray) and same_bits(p["w"], tree["params"]["w"])
    assert same_bits(p["b"], tree["params"]["b"])
    assert isinstance(p["layers"], list) and same_bits(p["layers"][0], tree["params"]["layers"][0])
    assert p["layers"][1].shape == (8, 0)
    mu_nu, none, counters = out["opt_state"]
    assert none is None  # a None leaf has no data but keeps its position
    assert mu_nu == {"mu": mu_nu["mu"], "nu": mu_nu["nu"]}  # objects come back as dicts
    assert same_bits(mu_nu["mu"], tree["opt_state"][0].mu)
    assert same_bits(mu_nu["nu"], np.arange(6.0))
    assert same_bits(counters["count"], np.int32(7))
    assert counters["lr"] == 0.5 and type(counters["lr"]) is float
    assert counters["flag"] is True
    assert counters["np_scalar"] == np.float32(2.5) and type(counters["np_scalar"]) is np.float32
    assert out["step"] == 12 and out["meta"] == tree["meta"]
    assert same_bits(out["single"], tree["single"])


def test_round_trip_into_the_saved_shardings(tmp_path, tree):
    checkpoint.save(tmp_path / "c", tree)
    target = jax.tree.map(
        lambda x: (
            jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
            if isinstance(x, jax.Array)
            else x
        ),
        tree,
    )
    out = checkpoint.restore(tmp_path / "c", target)
    for (path, got), want in zip(jax.tree_util.tree_leaves_with_path(out), jax.tree.leaves(tree)):
        where = jax.tree_util.keystr(path)
        assert same_bits(got, want), where
        if isinstance(want, jax.Array):
            assert isinstance(got, jax.Array) and got.sharding == want.sharding, where
        else:
            assert type(got) is type(want), where
    assert isinstance(out["opt_state"][0], Pair)  # the target's structure is kept


@pytest.mark.parametrize(
    ("mesh_shape", "spec"),
    [
        ((8,), P("x")),
        ((8,), P(None, "x")),
        ((8,), P()),
        ((4, 2), P("a", "b")),
        ((4, 2), P("b", "a")),
        ((2, 4), P(("a", "b"))),
        ((2, 4), P(None, ("b", "a"))),
        ((1, 8), P("b", "a")),
    ],
)
def test_restore_onto_named_shardings_on_several_meshes(tmp_path, mesh8, devices, mesh_shape, spec):
    w = values((64, 48), seed=1)
    checkpoint.save(tmp_path / "c", {"params": {"w": put(w, NamedSharding(mesh8, P("x")))}})
    names = ("x",) if len(mesh_shape) == 1 else ("a", "b")
    mesh = jax.make_mesh(mesh_shape, names, devices=devices)
    sharding = NamedSharding(mesh, spec)
    target = {"params": {"w": jax.ShapeDtypeStruct((64, 48), jnp.float32, sharding=sharding)}}
    got = checkpoint.restore(tmp_path / "c", target)["params"]["w"]
    assert got.sharding == sharding
    for shard in got.addressable_shards:
        assert same_bits(shard.data, w[shard.index])


def test_restore_onto_fewer_devices_and_a_single_device(tmp_path, mesh8, devices):
    w = values((64, 48), seed=1)
    checkpoint.save(tmp_path / "c", {"w": put(w, NamedSharding(mesh8, P(None, "x")))})
    mesh4 = jax.make_mesh((4,), ("y",), devices=devices[:4])
    for sharding in [
        NamedSharding(mesh4, P("y")),
        NamedSharding(jax.make_mesh((2,), ("y",), devices=devices[5:7]), P(None, "y")),
        SingleDeviceSharding(devices[6]),
    ]:
        got = checkpoint.restore(
            tmp_path / "c", {"w": jax.ShapeDtypeStruct(w.shape, w.dtype, sharding=sharding)}
        )["w"]
        assert got.sharding == sharding
        assert same_bits(got, w)


def test_a_target_sharding_that_does_not_fit_is_a_checkpoint_error(tmp_path, devices):
    checkpoint.save(tmp_path / "c", {"w": np.zeros((64, 48))})
    mesh3 = jax.make_mesh((3,), ("y",), devices=devices[:3])
    with pytest.raises(CheckpointError, match="'w': target sharding does not fit shape"):
        checkpoint.restore(tmp_path / "c", {"w": NamedSharding(mesh3, P("y"))})


def test_target_leaves_may_be_arrays_or_bare_shardings(tmp_path, mesh8, mesh24):
    w = values((16, 8), seed=1)
    checkpoint.save(tmp_path / "c", {"p": {"w": put(w, NamedSharding(mesh8, P("x"))), "v": w}})
    like = put(np.zeros_like(w), NamedSharding(mesh24, P("b", "a")))
    out = checkpoint.restore(tmp_path / "c", {"p": {"w": like, "v": NamedSharding(mesh24, P("a"))}})
    assert out["p"]["w"].sharding == like.sharding and same_bits(out["p"]["w"], w)
    assert out["p"]["v"].sharding == NamedSharding(mesh24, P("a")) and same_bits(out["p"]["v"], w)


def test_a_compiled_programs_input_shardings_can_be_the_target(tmp_path, mesh24):
    w = values((16, 8), seed=1)
    checkpoint.save(tmp_path / "c", {"params": {"w": w, "b": w[0]}})
    shardings = {"w": NamedSharding(mesh24, P("a", "b")), "b": NamedSharding(mesh24, P("b"))}
    abstract = {
        "w": jax.ShapeDtypeStruct(w.shape, w.dtype),
        "b": jax.ShapeDtypeStruct((8,), w.dtype),
    }
    compiled = (
        jax.jit(lambda p: p["w"] @ p["b"], in_shardings=(shardings,)).lower(abstract).compile()
    )
    (param_shardings,), _ = compiled.input_shardings
    target = jax.tree.map(
        lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, param_shardings
    )
    params = checkpoint.restore(tmp_path / "c", {"params": target})["params"]
    np.testing.assert_allclose(compiled(params), w @ w[0], rtol=1e-5)


def test_shape_dtype_struct_without_sharding_lands_on_the_first_local_device(tmp_path):
    checkpoint.save(tmp_path / "c", {"x": np.arange(4.0)})
    got = checkpoint.restore(tmp_path / "c", {"x": jax.ShapeDtypeStruct((4,), np.float64)})["x"]
    assert isinstance(got, jax.Array) and got.devices() == {jax.local_devices()[0]}


def test_target_dtype_differs_is_an_error_unless_cast(tmp_path):
    # A dtype change must not be a silent cast, as a shape change is an error.
    x = np.arange(4, dtype=np.float32)
    checkpoint.save(tmp_path / "c", {"st": {"x": x, "s": np.float32(1.5), "n": 3}})

    def restore(key, leaf, **kw):
        return checkpoint.restore(tmp_path / "c", {"st": {key: leaf}}, **kw)["st"][key]

    sds = jax.ShapeDtypeStruct((4,), jnp.bfloat16, sharding=SingleDeviceSharding(jax.devices()[0]))
    for key, leaf in [("x", sds), ("x", np.zeros(4, np.float64)), ("s", np.float16(0))]:
        with pytest.raises(CheckpointError, match=rf"'st/{key}': .*has float32; pass cast=True"):
            restore(key, leaf)
        got = restore(key, leaf, cast=True)
        assert got.dtype == leaf.dtype and got.shape == leaf.shape
        assert np.array_equal(np.asarray(got, np.float32), x if key == "x" else np.float32(1.5))
    # Python scalars hold any width of their kind, but not another kind.
    assert restore("n", 0) == 3 and restore("s", 0.0) == 1.5
    with pytest.raises(CheckpointError, match=r"'st/n': target is a Python float .*int64"):
        restore("n", 0.0)
    assert type(restore("n", 0.0, cast=True)) is float
    mgr = checkpoint.CheckpointManager(tmp_path / "run", save_interval_steps=1)
    mgr.save(0, {"x": x})
    with pytest.raises(CheckpointError, match="pass cast=True"):
        mgr.restore(0, {"x": sds})
    assert mgr.restore(0, {"x": sds}, cast=True)["x"].dtype == jnp.bfloat16
    mgr.close()


def test_partial_restore_by_item_reads_only_that_item(tmp_path, monkeypatch, mesh8):
    big = values((512, 256), seed=1)  # 512 KiB
    small = values((8, 8), seed=2)
    checkpoint.save(
        tmp_path / "c",
        {"opt_state": put(big, NamedSharding(mesh8, P("x"))), "params": {"w": small}, "n": 3},
    )
    read = []
    real = os.preadv
    monkeypatch.setattr(
        os, "preadv", lambda fd, bufs, off: read.append(real(fd, bufs, off)) or read[-1]
    )
    out = checkpoint.restore(tmp_path / "c", items=["params", "n"])
    assert list(out) == ["params", "n"] and same_bits(out["params"]["w"], small) and out["n"] == 3
    assert sum(read) == small.nbytes
    # A target naming a subset of the items restores just those, too.
    read.clear()
    out = checkpoint.restore(tmp_path / "c", {"params": {"w": small}})
    assert list(out) == ["params"] and sum(read) == small.nbytes


@pytest.mark.parametrize(
    ("mesh_shape", "spec"),
    [((8,), P("x")), ((2, 4), P(None, ("a", "b"))), ((4, 2), P("b", "a")), ((8,), P())],
)
def test_every_stored_byte_is_read_once_whatever_the_target_sharding(
    tmp_path, monkeypatch, devices, mesh_shape, spec
):
    big = values((64, 8192), seed=1)  # 2 MiB: 256 KiB per stored block
    _save_rows_over_8(tmp_path, big, devices)
    reads = _record_reads(monkeypatch)
    _restore_checked(tmp_path, big, devices, mesh_shape, spec)
    assert sum(hi - lo for _, lo, hi in reads) == big.nbytes


def _record_reads(monkeypatch):
    """Records each read of stored bytes from here on: ("preadv", start, stop) with the
    addresses of every buffer a preadv fills, ("mapped", 0, n) for every block of n
    bytes the reader maps from a data file."""
    reads = []
    real_preadv, real_fill = os.preadv, reader._fill_mapped

    def preadv(fd, bufs, off):
        reads.extend(("preadv", lo, hi) for lo, hi in _addresses(bufs))
        return real_preadv(fd, bufs, off)

    def fill_mapped(m, at, lo, start, stop, shard, chunk, *rest):
        hi = min(-(-stop // chunk) * chunk, shard.length)  # the block, in whole chunks
        reads.append(("mapped", lo, hi))
        return real_fill(m, at, lo, start, stop, shard, chunk, *rest)

    monkeypatch.setattr(os, "preadv", preadv)
    monkeypatch.setattr(reader, "_fill_mapped", fill_mapped)
    return reads


def _save_rows_over_8(tmp_path, big, devices):
    """``big`` saved as ``tmp_path/c`` with its rows split over 8 devices."""
    mesh8 = jax.make_mesh((8,), ("x",), devices=devices)
    checkpoint.save(tmp_path / "c", {"w": put(big, NamedSharding(mesh8, P("x")))})


def _restore_checked(tmp_path, big, devices, mesh_shape, spec):
    """``tmp_path/c`` restored onto ``spec`` over a ``mesh_shape`` mesh, checked equal to
    ``big`` bit for bit and laid out as asked."""
    names = ("x",) if len(mesh_shape) == 1 else ("a", "b")
    sharding = NamedSharding(jax.make_mesh(mesh_shape, names, devices=devices), spec)
    got = checkpoint.restore(
        tmp_path / "c", {"w": jax.ShapeDtypeStruct(big.shape, big.dtype, sharding=sharding)}
    )["w"]
    assert same_bits(got, big) and got.sharding == sharding
    return got


def test_items_must_exist(tmp_path):
    checkpoint.save(tmp_path / "c", {"params": np.zeros(2)})
    with pytest.raises(CheckpointError, match=r"no item\(s\) \['opt'\]; it has \['params'\]"):
        checkpoint.restore(tmp_path / "c", items=["opt"])


def test_target_array_missing_from_checkpoint_is_named(tmp_path):
    checkpoint.save(tmp_path / "c", {"params": {"w": np.zeros(2)}})
    with pytest.raises(CheckpointError, match=r"'params/v' of the target is not in the checkpoint"):
        checkpoint.restore(tmp_path / "c", {"params": {"v": np.zeros(2)}})


def test_target_shape_mismatch_is_named(tmp_path):
    checkpoint.save(tmp_path / "c", {"params": {"w": np.zeros((2, 3))}})
    with pytest.raises(CheckpointError, match=r"'params/w': target shape \(3, 2\)"):
        checkpoint.restore(
            tmp_path / "c", {"params": {"w": jax.ShapeDtypeStruct((3, 2), np.float64)}}
        )


def test_a_target_may_select_some_arrays_of_an_item(tmp_path):
    checkpoint.save(tmp_path / "c", {"params": {"w": np.ones(2), "b": np.zeros(3)}})
    assert list(checkpoint.restore(tmp_path / "c", {"params": {"b": np.zeros(3)}})["params"]) == [
        "b"
    ]


def test_replicated_data_is_stored_once_and_sharded_data_once_per_block(tmp_path, mesh8, mesh24):
    x = values((16, 8), seed=1)
    checkpoint.save(
        tmp_path / "c",
        {
            "rep": put(x, NamedSharding(mesh8, P())),
            "split": put(x, NamedSharding(mesh8, P("x"))),
            "half": put(x, NamedSharding(mesh24, P("a"))),  # 2 blocks, each on 4 devices
        },
    )
    layout = checkpoint.read_layout(tmp_path / "c")
    shards = {item.name: item.arrays.arrays[0].shards for item in layout.items}
    assert len(shards["rep"]) == 1 and len(shards["split"]) == 8 and len(shards["half"]) == 2
    assert layout.files[0].size_bytes >= x.nbytes * 3
    assert layout.files[0].size_bytes < x.nbytes * 3 + 64 * 11  # alignment padding only


def test_layout_records_path_shape_dtype_sharding_and_shards(tmp_path, mesh24):
    x = values((16, 8), "bfloat16", seed=1)
    checkpoint.save(
        tmp_path / "c", {"params": {"dense": [put(x, NamedSharding(mesh24, P("b", "a")))]}}
    )
    layout = checkpoint.read_layout(tmp_path / "c")
    assert isinstance(layout, pb.CheckpointLayout) and layout.layout_version == 1
    (record,) = layout.items[0].arrays.arrays
    assert [(e.WhichOneof("key"), e.container) for e in record.path] == [
        ("name", pb.CONTAINER_KIND_DICT),
        ("index", pb.CONTAINER_KIND_LIST),
    ]
    assert list(record.shape) == [16, 8] and record.dtype == "bfloat16"
    named = record.sharding.named
    assert [(a.name, a.size) for a in named.mesh_axes] == [("a", 2), ("b", 4)]
    assert [list(d.axes) for d in named.spec] == [["b"], ["a"]]
    assert len(record.shards) == 8
    first = record.shards[0]
    assert [(r.start, r.stop) for r in first.index] == [(0, 4), (0, 4)]
    assert first.length == 4 * 4 * 2 and len(first.chunk_checksums) == 1
    assert record.kind == pb.LEAF_KIND_JAX_ARRAY


def test_saving_onto_an_existing_checkpoint_needs_overwrite(tmp_path):
    checkpoint.save(tmp_path / "c", {"x": np.zeros(2)})
    with pytest.raises(CheckpointError, match="already exists; pass overwrite=True"):
        checkpoint.save(tmp_path / "c", {"x": np.ones(2)})
    checkpoint.save(tmp_path / "c", {"x": np.ones(2)}, overwrite=True)
    assert same_bits(checkpoint.restore(tmp_path / "c")["x"], np.ones(2))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c"]


@pytest.mark.parametrize(
    ("tree", "message"),
    [
        ([np.zeros(2)], "a checkpoint is a dict of named items"),
        ({"x": object()}, "leaf 'x' is a object"),
        ({"x": {"y": np.array(["a"])}}, "array 'x/y' has dtype <U1"),
        ({"x": [2**70, np.zeros(1)]}, "does not fit in int64"),
        ({3: np.zeros(1)}, "item names must be non-empty strings"),
    ],
)
def test_unsupported_values_are_named(tmp_path, tree, message):
    with pytest.raises(CheckpointError, match=message):
        checkpoint.save(tmp_path / "c", tree)
    assert not (tmp_path / "c").exists()


def test_read_layout_of_a_missing_or_foreign_directory(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        checkpoint.read_layout(tmp_path / "nope")
    (tmp_path / "d").mkdir()
    with pytest.raises(CheckpointError, match="not a committed checkpoint"):
        checkpoint.restore(tmp_path / "d")


@pytest.mark.parametrize("fmt", ["fcir", "orbax"])
def test_every_pwrite_of_a_save_into_the_page_cache_is_at_most_one_checksum_chunk(
    tmp_path, monkeypatch, mesh8, fmt
):
    """Writes into the page cache larger than 1 MiB were erratically 3-10x slower on this
    project's machines (see writer.WRITE_BYTES): a 2.5 MiB shard's part short of a whole
    chunk, or all of it where direct I/O is refused, goes in calls of at most 1 MiB.
    Direct writes (fds opened with O_DIRECT) are aligned and at most DIRECT_BYTES."""
    import fcntl

    from fcir.checkpoint import checksums, writer

    cached, direct = [], []
    real = os.pwrite

    def recording(fd, data, offset):
        is_direct = fcntl.fcntl(fd, fcntl.F_GETFL) & getattr(os, "O_DIRECT", 0)
        (direct if is_direct else cached).append((len(data), offset))
        return real(fd, data, offset)

    monkeypatch.setattr(writer.os, "pwrite", recording)
    big = put(values((8, 5 * 2**17)), NamedSharding(mesh8, P("x")))  # 8 shards of 2.5 MiB
    checkpoint.save(tmp_path / "c", {"p": {"big": big, "small": np.arange(3)}}, format=fmt)
    assert max(n for n, _ in cached) <= checksums.CHUNK_BYTES == writer.WRITE_BYTES
    assert all(n <= writer.DIRECT_BYTES and n % 4096 == 0 == o % 4096 for n, o in direct)
    assert sum(n for n, _ in cached + direct) >= big.nbytes
    assert len(cached) + len(direct) >= 8 * 2
    assert same_bits(np.asarray(checkpoint.restore(tmp_path / "c")["p"]["big"]), np.asarray(big))


def _addresses(buffers):
    out = []
    for b in buffers:
        a = np.frombuffer(b, np.uint8)
        out.append((a.ctypes.data, a.ctypes.data + a.nbytes))
    return out


@pytest.mark.parametrize(
    ("mesh_shape", "spec"),
    [((8,), P("x")), ((4, 2), P("a", "b")), ((2, 4), P(None, ("a", "b")))],
)
def test_a_restore_onto_another_sharding_reads_each_byte_once_with_no_scratch_copy(
    tmp_path, monkeypatch, devices, mesh_shape, spec
):
    """Onto the saved sharding the restored arrays' shards are (on CPU) the data file's
    own pages, mapped copy-on-write and verified in place, with no preadv at all (before
    reader.plan_mapped, every preadv filled memory of the shards); half rows (4, 2) and
    quarter rows of 256 KiB stored rows are copied from a mapping of the data file into
    the arrays. Either way no byte passes through a scratch buffer, and each is read
    once."""
    big = values((64, 65536), seed=3)  # 16 MiB: stored rows of 256 KiB
    _save_rows_over_8(tmp_path, big, devices)
    reads = _record_reads(monkeypatch)
    monkeypatch.setattr(reader, "_scratch", lambda n: pytest.fail("a scratch buffer was used"))
    got = _restore_checked(tmp_path, big, devices, mesh_shape, spec)
    shards = _addresses(
        memoryview(np.asarray(s.data).reshape(-1).view(np.uint8)) for s in got.addressable_shards
    )
    filled = [(lo, hi) for kind, lo, hi in reads if kind == "preadv"]
    assert all(any(a <= lo and hi <= b for a, b in shards) for lo, hi in filled)
    assert sum(hi - lo for _, lo, hi in reads) == big.nbytes
    assert not filled
    (data,) = (tmp_path / "c").glob("data-*.bin")
    maps = mapped_from(data)
    in_file = [any(a <= lo and hi <= b for a, b in maps) for lo, hi in shards]
    assert in_file == [mesh_shape == (8,)] * len(shards)
