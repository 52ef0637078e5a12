"""Checkpoints at s3://, gs:// and file:// URLs; S3 through a local moto_server."""

from __future__ import annotations

import itertools
import os
import subprocess
import sys

import jax
import numpy as np
import pytest
from ckpt_testing import REPO, child_env, same_bits, values
from fcir.checkpoint import storage
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from fcir import checkpoint
from fcir.errors import CheckpointError

_names = itertools.count()


@pytest.fixture
def url(s3_endpoint):
    from s3_testing import BUCKET

    return f"s3://{BUCKET}/t{next(_names)}"


def _keys(endpoint, url):
    from s3_testing import BUCKET, keys

    return keys(endpoint, url.removeprefix(f"s3://{BUCKET}/") + "/")


def _tree(devices, step=0):
    mesh = jax.make_mesh((8,), ("x",), devices=devices)
    mesh24 = jax.make_mesh((2, 4), ("a", "b"), devices=devices)
    w = values((64, 24), seed=1) + step
    m = values((16, 8), "bfloat16", seed=2)
    return {
        "params": {
            "w": jax.device_put(w, NamedSharding(mesh, P("x"))),
            "m": jax.device_put(m, NamedSharding(mesh24, P("b", "a"))),
            "r": jax.device_put(values((5,), seed=3), NamedSharding(mesh, P())),
        },
        "host": {"n": np.arange(10), "s": 3.5},
        "meta": {"round": step},
    }


def _check(out, tree):
    for k, v in tree["params"].items():
        assert same_bits(np.asarray(out["params"][k]), np.asarray(v)), k


def test_a_tree_saved_to_s3_restores_onto_another_sharding_and_to_host(url, devices):
    tree = _tree(devices)
    checkpoint.save(url, tree)
    other = jax.make_mesh((4, 2), ("a", "b"), devices=devices)
    target = {
        k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=NamedSharding(other, P("b", "a")))
        for k, v in tree["params"].items()
        if v.ndim == 2
    }
    out = checkpoint.restore(url, {"params": target})
    for k, arr in out["params"].items():
        assert arr.sharding == target[k].sharding
        assert same_bits(np.asarray(arr), np.asarray(tree["params"][k])), k
    host = checkpoint.restore(url)
    _check(host, tree)
    assert host["meta"] == {"round": 0} and host["host"]["s"] == 3.5


def test_an_object_store_save_commits_by_writing_the_layout_last(url, devices, monkeypatch):
    """A save that dies before its layout leaves nothing a reader takes for a checkpoint."""
    written = []
    real = storage.ObjectStore.write_many

    def write_many(self, objects):
        objects = list(objects)
        written.extend(k for k, _ in objects)
        if any(k == "layout.pb" for k, _ in objects):
            raise KeyboardInterrupt  # killed just before the commit
        return real(self, objects)

    monkeypatch.setattr(storage.ObjectStore, "write_many", write_many)
    with pytest.raises(KeyboardInterrupt):
        checkpoint.save(url, _tree(devices))
    assert written[-1] == "layout.pb" and all(k.startswith("data-") for k in written[:-1])
    monkeypatch.undo()
    with pytest.raises(CheckpointError, match="not a committed checkpoint"):
        checkpoint.restore(url)
    checkpoint.save(url, _tree(devices, step=1))  # not "already exists"
    _check(checkpoint.restore(url), _tree(devices, step=1))


def test_overwriting_an_s3_checkpoint_replaces_it_and_deletes_the_old_objects(
    url, devices, s3_endpoint
):
    checkpoint.save(url, _tree(devices))
    before = _keys(s3_endpoint, url)
    with pytest.raises(CheckpointError, match="already exists; pass overwrite=True"):
        checkpoint.save(url, _tree(devices, step=2))
    checkpoint.save(url, _tree(devices, step=2), overwrite=True)
    after = _keys(s3_endpoint, url)
    assert not set(before) - {url.split("/", 3)[3] + "/layout.pb"} & set(after)
    assert sum(k.endswith(".bin") for k in after) == 1 and not any("part" in k for k in after)
    _check(checkpoint.restore(url), _tree(devices, step=2))


def test_an_async_save_to_s3_returns_before_the_commit_and_wait_commits(url, devices):
    handle = checkpoint.save(url, _tree(devices), blocking=False)
    handle.wait()
    assert handle.done()
    _check(checkpoint.restore(url), _tree(devices))


def test_large_shards_go_to_several_objects_written_concurrently(url, devices, monkeypatch):
    from fcir.checkpoint import writer

    monkeypatch.setattr(writer, "OBJECT_BYTES", 2000)
    tree = _tree(devices)
    checkpoint.save(url, tree)
    layout = checkpoint.read_layout(url)
    assert len(layout.files) > 3
    _check(checkpoint.restore(url), tree)


def test_a_manager_over_s3_keeps_the_newest_steps_and_ignores_uncommitted_ones(
    url, devices, s3_endpoint
):
    from s3_testing import BUCKET, client

    prefix = url.split("/", 3)[3]
    client(s3_endpoint).put_object(Bucket=BUCKET, Key=f"{prefix}/1/data-x-p00000-000.bin", Body=b"")
    mgr = checkpoint.CheckpointManager(url, max_to_keep=2)
    assert mgr.all_steps() == [] and mgr.latest_step() is None
    # No newer step is committed: step 1 may be another manager's save in flight.
    assert len(_keys(s3_endpoint, url)) == 1
    for step in range(2, 6):
        mgr.save(step, _tree(devices, step))
    mgr.wait_until_finished()
    assert mgr.all_steps() == [4, 5]
    again = checkpoint.CheckpointManager(url)  # step 1 is older than a committed one
    assert {k.split("/")[1] for k in _keys(s3_endpoint, url)} == {"4", "5"}
    _check(mgr.restore(), _tree(devices, 5))
    assert again.latest_step() == 5
    _check(again.restore(4), _tree(devices, 4))


def test_a_flipped_byte_in_an_s3_object_is_an_error_naming_array_and_object(
    url, devices, s3_endpoint
):
    from s3_testing import BUCKET, client

    tree = _tree(devices)
    checkpoint.save(url, tree)
    layout = checkpoint.read_layout(url)
    record = next(a for a in layout.items[0].arrays.arrays if a.path[0].name == "w")
    shard = record.shards[3]
    key = f"{url.split('/', 3)[3]}/{layout.files[shard.file].name}"
    s3 = client(s3_endpoint)
    body = bytearray(s3.get_object(Bucket=BUCKET, Key=key)["Body"].read())
    body[shard.offset + 17] ^= 0x10
    s3.put_object(Bucket=BUCKET, Key=key, Body=bytes(body))
    with pytest.raises(CheckpointError, match=r"'params/w'.*data-.*checksum mismatch"):
        checkpoint.restore(url)
    result = subprocess.run(
        [sys.executable, "-m", "fcir.cli", "ckpt", "inspect", url],
        capture_output=True,
        text=True,
        env={**os.environ, **child_env(1)},
        cwd=REPO,
        timeout=300,
    )
    assert result.returncode == 1 and "integrity: FAILED" in result.stdout, result.stderr


def test_fcir_ckpt_inspect_reads_an_s3_checkpoint(url, devices):
    checkpoint.save(url, _tree(devices))
    result = subprocess.run(
        [sys.executable, "-m", "fcir.cli", "ckpt", "inspect", url],
        capture_output=True,
        text=True,
        env={**os.environ, **child_env(1)},
        cwd=REPO,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    assert f"checkpoint {url}" in result.stdout and "integrity: OK" in result.stdout


def test_a_file_url_is_the_local_directory(tmp_path, devices):
    tree = _tree(devices)
    checkpoint.save(f"file://{tmp_path}/c", tree)
    assert (tmp_path / "c" / "layout.pb").is_file()
    _check(checkpoint.restore(tmp_path / "c"), tree)
    _check(checkpoint.restore(f"file://{tmp_path}/c"), tree)
    mgr = checkpoint.CheckpointManager(f"file://{tmp_path}/run")
    mgr.save(1, tree, blocking=True)
    assert (tmp_path / "run" / "1" / "layout.pb").is_file()


@pytest.mark.parametrize(
    "url", ["memory://b/ckpt", "azure://b/ckpt", "http://host/ckpt", "file://otherhost/ckpt"]
)
def test_a_url_without_a_backend_is_an_error_and_never_a_local_folder(tmp_path, monkeypatch, url):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(CheckpointError, match="no checkpoint storage for|must name a local path"):
        checkpoint.save(url, {"meta": {"a": 1}})
    with pytest.raises(CheckpointError):
        checkpoint.restore(url)
    with pytest.raises(CheckpointError):
        checkpoint.CheckpointManager(url)
    assert list(tmp_path.iterdir()) == []


def test_a_url_mangled_by_pathlib_is_an_error(tmp_path, monkeypatch):
    import pathlib

    monkeypatch.chdir(tmp_path)
    with pytest.raises(CheckpointError, match="lost a slash"):
        checkpoint.save(pathlib.Path("gs://b/ckpt"), {"meta": {"a": 1}})
    assert list(tmp_path.iterdir()) == []


def _without_cloud_credentials(monkeypatch, tmp_path):
    for k in list(os.environ):
        if k.startswith(("AWS_", "GOOGLE_", "TENSORSTORE_GCS")):
            monkeypatch.delenv(k)
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setattr(storage, "_vendor_is", lambda name: False)
    monkeypatch.chdir(tmp_path)


@pytest.mark.parametrize(
    ("url", "match"),
    [("s3://bucket/ckpt", "no AWS credentials"), ("gs://bucket/ckpt", "no Google Cloud")],
)
def test_missing_credentials_are_an_error_and_never_a_local_folder(
    tmp_path, monkeypatch, url, match
):
    _without_cloud_credentials(monkeypatch, tmp_path)
    with pytest.raises(CheckpointError, match=match):
        checkpoint.save(url, {"meta": {"a": 1}})
    with pytest.raises(CheckpointError, match=match):
        checkpoint.restore(url)
    with pytest.raises(CheckpointError, match=match):
        checkpoint.CheckpointManager(url).all_steps()
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow  # waits out the capped retries (~11 s)
def test_an_unreachable_endpoint_is_a_checkpoint_error(tmp_path, monkeypatch):
    from ckpt_testing import free_port

    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "x")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "x")
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{free_port()}")
    with pytest.raises(CheckpointError, match="s3://bucket/ckpt"):
        checkpoint.restore("s3://bucket/ckpt")


@pytest.mark.slow  # two processes (docs/contributing.md)
def test_two_processes_write_their_own_objects_and_one_commits(url, s3_endpoint, devices, tmp_path):
    from ckpt_testing import free_port
    from s3_testing import child_s3_env
    from test_multiprocess import WORKER, run_all

    port = str(free_port())
    run_all(
        [
            ([WORKER, "s3pair", url, port, str(i)], child_s3_env(s3_endpoint, child_env(4)))
            for i in range(2)
        ],
        timeout=200,
    )
    layout = checkpoint.read_layout(url + "/blocking")
    assert {f.process_index for f in layout.files} == {0, 1}
    assert not any("part" in k for k in _keys(s3_endpoint, url))
    out = checkpoint.restore(url + "/async")["params"]
    from mp_worker import EXPECTED

    for k, v in EXPECTED.items():
        assert same_bits(out[k], v + 1), k
    # In Orbax's format too: each process PUT its own chunks, and Orbax reads them all.
    ocp = pytest.importorskip("orbax.checkpoint")
    layout = checkpoint.read_layout(url + "/orbax")
    assert {f.process_index for f in layout.files} == {0, 1}
    assert all(f.name.startswith(("params/", "host/")) for f in layout.files)
    mesh = jax.make_mesh((8,), ("x",), devices=devices)
    abstract = {
        k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=NamedSharding(mesh, P()))
        for k, v in EXPECTED.items()
    }
    local = _download(s3_endpoint, url + "/orbax", tmp_path / "orbax")
    got = ocp.StandardCheckpointer().restore(local / "params", abstract)
    for k, v in EXPECTED.items():
        assert same_bits(np.asarray(got[k]), v + 3), k


@pytest.mark.parametrize("ocdbt", [True, False], ids=["ocdbt", "zarr-directories"])
def test_an_orbax_checkpoint_in_s3_restores_onto_another_sharding(
    url, devices, s3_endpoint, tmp_path, ocdbt
):
    ocp = pytest.importorskip("orbax.checkpoint")
    from s3_testing import BUCKET, client

    tree = _tree(devices)["params"]
    ocp.Checkpointer(ocp.PyTreeCheckpointHandler(use_ocdbt=ocdbt)).save(
        tmp_path / "ox", args=ocp.args.PyTreeSave(tree)
    )
    s3 = client(s3_endpoint)
    prefix = url.split("/", 3)[3]
    for f in (tmp_path / "ox").rglob("*"):
        if f.is_file():
            s3.put_object(
                Bucket=BUCKET, Key=f"{prefix}/{f.relative_to(tmp_path / 'ox')}", Body=f.read_bytes()
            )
    other = jax.make_mesh((4, 2), ("a", "b"), devices=devices)
    target = {
        k: jax.ShapeDtypeStruct(
            v.shape, v.dtype, sharding=NamedSharding(other, P("b") if v.ndim == 2 else P())
        )
        for k, v in tree.items()
    }
    out = checkpoint.restore(url, {"default": target})["default"]
    for k, v in tree.items():
        assert out[k].sharding == target[k].sharding
        assert same_bits(np.asarray(out[k]), np.asarray(v)), k


def test_a_manager_over_s3_leaves_foreign_objects_under_step_numbers_alone(url, s3_endpoint):
    """Only fcir's own leftovers are cleaned: an Orbax step being written survives, and a
    committed Orbax step (commit_success.txt) counts as a step."""
    from s3_testing import BUCKET, client

    prefix = url.split("/", 3)[3]
    s3 = client(s3_endpoint)
    for key in (
        "4/_METADATA",
        "4/d/abc",
        "6/_METADATA",
        "6/commit_success.txt",
        "5/data-x-p00000-000.bin",
    ):
        s3.put_object(Bucket=BUCKET, Key=f"{prefix}/{key}", Body=b"{}")
    mgr = checkpoint.CheckpointManager(url)
    assert mgr.all_steps() == [6]
    left = {k.split("/", 1)[1] for k in _keys(s3_endpoint, url)}
    assert left == {"4/_METADATA", "4/d/abc", "6/_METADATA", "6/commit_success.txt"}


def _download(endpoint, url, dest):
    """Copies every object under `url` into the local directory `dest`, as keys say."""
    from s3_testing import BUCKET, client

    s3 = client(endpoint)
    prefix = url.removeprefix(f"s3://{BUCKET}/") + "/"
    for key in _keys(endpoint, url):
        path = dest / key.removeprefix(prefix)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(s3.get_object(Bucket=BUCKET, Key=key)["Body"].read())
    return dest


def _orbax_tree(devices):
    """Arrays sharded, replicated, partly replicated, on one device, 0-d and numpy."""
    mesh24 = jax.make_mesh((2, 4), ("a", "b"), devices=devices)
    tree = _tree(devices)["params"]
    return {
        **tree,
        "half": jax.device_put(values((8, 6), seed=7), NamedSharding(mesh24, P("a"))),
        "dev3": jax.device_put(values((5,), "int32", seed=8), devices[3]),
        "zero_d": jax.device_put(np.float32(2.5), NamedSharding(mesh24, P())),
        "host": values((7,), seed=9),
    }


def test_orbax_format_saved_to_s3_is_what_orbax_restores_and_fcir_verifies(
    url, s3_endpoint, devices, tmp_path
):
    ocp = pytest.importorskip("orbax.checkpoint")
    tree = _orbax_tree(devices)
    checkpoint.save(url, {"default": tree}, format="orbax")
    keys = {k.split("/", 1)[1] for k in _keys(s3_endpoint, url)}
    assert {"layout.pb", "commit_success.txt", "_METADATA", "w/.zarray", "w/7.0"} <= keys
    assert not any("part" in k for k in keys)
    # Orbax reads the very objects fcir wrote (copied byte for byte to a local folder).
    abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, tree)
    got = ocp.StandardCheckpointer().restore(_download(s3_endpoint, url, tmp_path / "c"), abstract)
    for k, v in tree.items():
        assert same_bits(np.asarray(got[k]), np.asarray(v)), k
    other = jax.make_mesh((4, 2), ("a", "b"), devices=devices)
    target = {
        k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=NamedSharding(other, P()))
        for k, v in tree.items()
    }
    out = checkpoint.restore(url, {"default": target})["default"]
    for k, v in tree.items():
        assert same_bits(np.asarray(out[k]), np.asarray(v)), k
    assert checkpoint.read_layout(url).files[0].name.count("/") == 1  # the chunk objects


def test_several_orbax_format_items_in_s3_are_item_prefixes_an_orbax_manager_restores(
    url, s3_endpoint, devices, tmp_path
):
    ocp = pytest.importorskip("orbax.checkpoint")
    tree = _tree(devices)["params"]
    checkpoint.save(f"{url}/3", {"params": tree, "meta": {"round": 3}}, format="orbax")
    got = ocp.CheckpointManager(_download(s3_endpoint, url, tmp_path / "run")).restore(
        3,
        args=ocp.args.Composite(
            params=ocp.args.StandardRestore(jax.tree.map(ocp.utils.to_shape_dtype_struct, tree)),
            meta=ocp.args.JsonRestore(),
        ),
    )
    for k, v in tree.items():
        assert same_bits(np.asarray(got["params"][k]), np.asarray(v)), k
    assert got["meta"] == {"round": 3}
    assert checkpoint.CheckpointManager(url).all_steps() == [3]


def test_a_one_item_orbax_manager_step_in_s3_is_in_its_item_prefix_and_overwritten_whole(
    url, s3_endpoint, devices, tmp_path
):
    ocp = pytest.importorskip("orbax.checkpoint")
    tree = _tree(devices)["params"]
    mgr = checkpoint.CheckpointManager(url, format="orbax")
    mgr.save(0, {"state": tree}, blocking=True)
    keys = {k.split("/", 1)[1] for k in _keys(s3_endpoint, url)}
    assert {"0/commit_success.txt", "0/_CHECKPOINT_METADATA", "0/state/_METADATA"} <= keys
    assert "0/state/w/7.0" in keys and "0/_METADATA" not in keys
    abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, tree)
    omgr = ocp.CheckpointManager(_download(s3_endpoint, url, tmp_path / "run"))
    got = omgr.restore(0, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract)))
    omgr.close()
    for k, v in tree.items():
        assert same_bits(np.asarray(got["state"][k]), np.asarray(v)), k
    # A plain save over that step lays its one item out in the step itself; the old
    # layout's item prefix, metadata included, goes entirely.
    checkpoint.save(
        f"{url}/0", {"state": {"u": values((4,), seed=3)}}, format="orbax", overwrite=True
    )
    keys = {k.split("/", 1)[1] for k in _keys(s3_endpoint, url)}
    assert not any(k.startswith("0/state/") for k in keys), sorted(keys)
    assert {"0/_METADATA", "0/u/0"} <= keys


def test_orbax_itself_cannot_open_s3_which_is_why_the_docs_copy_the_objects_down(
    url, s3_endpoint, devices
):
    """docs/checkpoint.md says Orbax 0.12.8 neither reads nor writes s3:// (it asks for
    s3fs; with s3fs it opens `s3:/...` as a local file). When this fails, Orbax can:
    update the docs."""
    ocp = pytest.importorskip("orbax.checkpoint")
    tree = {"w": jax.device_put(values((8,), seed=1))}
    checkpoint.save(url, {"default": tree}, format="orbax")
    abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, tree)
    with pytest.raises((ImportError, ValueError), match=r"s3fs|s3:/"):
        ocp.StandardCheckpointer().restore(url, abstract)
    saver = ocp.StandardCheckpointer()
    with pytest.raises((ImportError, ValueError), match=r"s3fs|s3:/"):
        saver.save(f"{url}/by_orbax", tree)
        saver.wait_until_finished()


def test_a_flipped_byte_in_an_orbax_format_chunk_in_s3_is_caught(url, s3_endpoint, devices):
    from s3_testing import BUCKET, client

    checkpoint.save(url, {"default": _tree(devices)["params"]}, format="orbax")
    s3, key = client(s3_endpoint), url.removeprefix(f"s3://{BUCKET}/") + "/w/2.0"
    data = bytearray(s3.get_object(Bucket=BUCKET, Key=key)["Body"].read())
    data[100] ^= 0x10
    s3.put_object(Bucket=BUCKET, Key=key, Body=bytes(data))
    with pytest.raises(CheckpointError, match=r"'default/w'.*w/2\.0.*checksum mismatch"):
        checkpoint.restore(url)


def test_overwriting_an_orbax_format_s3_checkpoint_leaves_only_the_new_one(
    url, s3_endpoint, devices, tmp_path
):
    ocp = pytest.importorskip("orbax.checkpoint")
    mesh = jax.make_mesh((8,), ("x",), devices=devices)
    old = {"gone": jax.device_put(values((16, 4), seed=1), NamedSharding(mesh, P("x")))}
    new = {"kept": jax.device_put(values((8, 4), seed=2), NamedSharding(mesh, P(None)))}
    checkpoint.save(url, {"default": old}, format="orbax")
    with pytest.raises(CheckpointError, match="already exists; pass overwrite=True"):
        checkpoint.save(url, {"default": new}, format="orbax")
    checkpoint.save(url, {"default": new}, format="orbax", overwrite=True)
    keys = {k.split("/", 1)[1] for k in _keys(s3_endpoint, url)}
    assert not any(k.startswith("gone/") for k in keys) and "kept/0.0" in keys
    got = ocp.StandardCheckpointer().restore(
        _download(s3_endpoint, url, tmp_path / "c"),
        jax.tree.map(ocp.utils.to_shape_dtype_struct, new),
    )
    assert same_bits(np.asarray(got["kept"]), np.asarray(new["kept"]))


def test_an_orbax_written_checkpoint_in_s3_is_never_overwritten_in_part(url, s3_endpoint):
    """fcir does not know every object of a checkpoint Orbax wrote, so it refuses to
    write over one rather than leave some of them mixed into its own."""
    from s3_testing import BUCKET, client

    prefix = url.removeprefix(f"s3://{BUCKET}/")
    for key in ("_METADATA", "commit_success.txt"):
        client(s3_endpoint).put_object(Bucket=BUCKET, Key=f"{prefix}/{key}", Body=b"{}")
    tree = {"default": {"a": np.arange(4.0)}}
    with pytest.raises(CheckpointError, match="already exists"):
        checkpoint.save(url, tree, format="orbax")
    with pytest.raises(CheckpointError, match="Orbax checkpoint that fcir did not write"):
        checkpoint.save(url, tree, format="orbax", overwrite=True)
    assert {k.split("/", 1)[1] for k in _keys(s3_endpoint, url)} == {
        "_METADATA",
        "commit_success.txt",
    }


def test_an_orbax_format_s3_save_commits_for_fcir_before_orbax_sees_it(
    url, s3_endpoint, devices, monkeypatch
):
    """layout.pb is written after every chunk, and Orbax's metadata and commit marker
    after layout.pb: before layout.pb the prefix is no checkpoint to either reader."""
    seen = []
    real = storage.ObjectStore.write_many

    def recording(self, objects):
        objects = list(objects)
        for key, _ in objects:
            seen.append(key)
            if key == "layout.pb":
                with pytest.raises(CheckpointError, match="not a committed checkpoint"):
                    checkpoint.restore(url)
        real(self, objects)

    monkeypatch.setattr(storage.ObjectStore, "write_many", recording)
    checkpoint.save(url, {"default": _tree(devices)["params"]}, format="orbax")
    chunks = [
        k for k in seen if "/" in k and not k.endswith(".zarray") and "array_metadatas" not in k
    ]
    assert len(chunks) == 8 + 8 + 1  # w over 8 devices, m over 8, r replicated
    assert seen.index("layout.pb") > max(seen.index(k) for k in chunks)
    assert seen.index("_METADATA") > seen.index("layout.pb")
    assert seen[-1] == "commit_success.txt"


def test_an_fcir_format_s3_checkpoint_can_be_overwritten_in_orbax_format(url, s3_endpoint, devices):
    checkpoint.save(url, {"p": {"a": np.arange(3.0)}})
    checkpoint.save(url, {"meta": {"round": 2}}, overwrite=True)  # JSON only: no Orbax
    # metadata describes this layout, and its data objects are gone
    new = {"default": {"w": jax.device_put(values((8, 4)), devices[0])}}
    checkpoint.save(url, new, format="orbax", overwrite=True)
    keys = {k.split("/", 1)[1] for k in _keys(s3_endpoint, url)}
    assert not any(k.startswith("data-") for k in keys) and "w/0.0" in keys
    got = checkpoint.restore(url)["default"]["w"]
    assert same_bits(got, np.asarray(new["default"]["w"]))
