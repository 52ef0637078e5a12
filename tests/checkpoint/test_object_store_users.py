"""Object stores as users meet them: an Orbax checkpoint still being written into a
prefix, and credentials the server refuses (told apart from missing ones and from an
endpoint that cannot be reached)."""

from __future__ import annotations

import itertools
import time

import numpy as np
import pytest

from fcir import checkpoint
from fcir.errors import CheckpointError

pytest.importorskip("boto3", reason="the test extra has boto3 and moto[server]")
pytest.importorskip("moto.server", reason="the test extra has moto[server]")

_names = itertools.count()


def _upload(endpoint, local, prefix, skip=()):
    from s3_testing import BUCKET, client

    s3 = client(endpoint)
    for f in local.rglob("*"):
        rel = f.relative_to(local).as_posix()
        if f.is_file() and rel not in skip:
            s3.put_object(Bucket=BUCKET, Key=f"{prefix}/{rel}", Body=f.read_bytes())


def test_an_orbax_checkpoint_in_s3_without_its_commit_marker_is_not_read(s3_endpoint, tmp_path):
    """Orbax writes commit_success.txt last where nothing can be renamed; before it the
    prefix holds a save in progress (or a dead one's), which fcir must not read."""
    ocp = pytest.importorskip("orbax.checkpoint")
    from s3_testing import BUCKET

    ocp.PyTreeCheckpointer().save(tmp_path / "ox", {"w": np.arange(4.0)})
    # The manager saves in the background: wait on that manager, not on a new one (which
    # has nothing to wait for, so on a loaded machine the step was not there yet).
    manager = ocp.CheckpointManager(tmp_path / "run")
    manager.save(2, args=ocp.args.Composite(state=ocp.args.StandardSave({"w": np.arange(4.0)})))
    manager.wait_until_finished()
    url = f"s3://{BUCKET}/orbax{next(_names)}"
    _upload(s3_endpoint, tmp_path / "ox", url.split("/", 3)[3], skip={"commit_success.txt"})
    _upload(s3_endpoint, tmp_path / "run", url.split("/", 3)[3] + "-run")
    with pytest.raises(CheckpointError, match="not a committed Orbax checkpoint.*commit_success"):
        checkpoint.restore(url)
    with pytest.raises(CheckpointError, match="not a committed Orbax checkpoint"):
        checkpoint.restore(url, {"default": {"w": np.zeros(4)}})
    # A manager's step carries the marker; its item folders are read through it.
    step = f"{url}-run/2"
    assert checkpoint.restore(step)["state"]["w"].tolist() == [0, 1, 2, 3]
    assert checkpoint.restore(f"{step}/state")["default"]["w"].tolist() == [0, 1, 2, 3]


def test_refused_credentials_are_an_error_that_says_so_quickly(monkeypatch):
    from s3_testing import moto_server

    # moto checks signatures when told to; the key below is in none of its records.
    with moto_server(INITIAL_NO_AUTH_ACTION_COUNT="0") as endpoint:
        monkeypatch.setenv("AWS_ENDPOINT_URL", endpoint)
        monkeypatch.setenv("AWS_ACCESS_KEY_ID", "not-a-key")
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-a-secret")
        monkeypatch.setenv("AWS_REGION", "us-east-1")
        started = time.monotonic()
        for call in (
            lambda: checkpoint.restore("s3://some-bucket/ckpt"),
            lambda: checkpoint.save("s3://some-bucket/ckpt", {"a": {"x": np.arange(3)}}),
            lambda: checkpoint.CheckpointManager("s3://some-bucket/run").all_steps(),
        ):
            with pytest.raises(CheckpointError, match="refused the credentials.*AWS_ACCESS_KEY_ID"):
                call()
        assert time.monotonic() - started < 30  # a refusal is not retried


@pytest.mark.slow  # waits out the capped retries (~11 s)
def test_an_unreachable_endpoint_is_an_error_that_says_so(monkeypatch):
    from ckpt_testing import free_port

    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "x")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "x")
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{free_port()}")
    started = time.monotonic()
    with pytest.raises(CheckpointError, match="s3://bucket/ckpt: the endpoint cannot be reached"):
        checkpoint.restore("s3://bucket/ckpt")
    assert time.monotonic() - started < 60  # tensorstore's retries are capped


def test_an_orbax_train_state_in_s3_restores_with_its_typed_keys_and_empty_subtrees(
    s3_endpoint, tmp_path
):
    """Orbax's array metadata (which names typed keys' impl) is listed and read from
    the object store as from a directory."""
    ocp = pytest.importorskip("orbax.checkpoint")
    import jax
    import optax
    from s3_testing import BUCKET

    params = {"w": np.arange(6.0, dtype=np.float32).reshape(2, 3)}
    state = {"opt": optax.adam(0.1).init(params), "key": jax.random.key(5), "none": None}
    ocp.Checkpointer(ocp.PyTreeCheckpointHandler(use_ocdbt=False)).save(
        tmp_path / "ox", args=ocp.args.PyTreeSave(state)
    )
    url = f"s3://{BUCKET}/state{next(_names)}"
    _upload(s3_endpoint, tmp_path / "ox", url.split("/", 3)[3])
    host = checkpoint.restore(url)["default"]
    assert host["none"] is None and host["opt"][1] is None
    assert host["key"].dtype == state["key"].dtype
    abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, state)
    out = checkpoint.restore(url, {"default": abstract})["default"]
    assert jax.tree.structure(out) == jax.tree.structure(state)
    assert (jax.random.key_data(out["key"]) == jax.random.key_data(state["key"])).all()
