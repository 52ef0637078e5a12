"""Checkpoint tests run on 8 simulated CPU devices.

XLA reads XLA_FLAGS when the CPU backend starts, so setting it here (at collection,
before any test touches a device) gives every test in the session 8 devices.
"""

from __future__ import annotations

import os
import pathlib
import sys
import threading

_FLAG = "--xla_force_host_platform_device_count=8"
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _FLAG).strip()

import jax  # noqa: E402  (XLA_FLAGS must be set first)
import pytest  # noqa: E402

HERE = pathlib.Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))


@pytest.fixture(scope="session")
def devices() -> list[jax.Device]:
    # CPU devices by name: on a machine with an accelerator, jax.devices() is its.
    devs = jax.devices("cpu")
    if len(devs) < 8:
        pytest.fail(
            f"checkpoint tests need 8 CPU devices, got {len(devs)}: the backend started "
            "before tests/checkpoint/conftest.py could set XLA_FLAGS; run them alone "
            f"or export XLA_FLAGS={_FLAG}"
        )
    return devs[:8]


@pytest.fixture(scope="session")
def s3_server():
    """One local S3 server (moto_server, ~7 s to start) with ``s3_testing.BUCKET`` for
    every test of the session that needs S3; each module keeps to its own key prefix."""
    pytest.importorskip("boto3", reason="the test extra has boto3 and moto[server]")
    pytest.importorskip("moto.server", reason="the test extra has moto[server]")
    from s3_testing import BUCKET, client, moto_server

    with moto_server() as endpoint:
        client(endpoint).create_bucket(Bucket=BUCKET)
        yield endpoint


@pytest.fixture(scope="module")
def s3_endpoint(s3_server):
    """The session's S3 endpoint, with the AWS_* variables that point boto3 and
    tensorstore at it set for the module."""
    from s3_testing import s3_env

    with pytest.MonkeyPatch.context() as mp:
        for k, v in s3_env(s3_server).items():
            mp.setenv(k, v)
        yield s3_server


@pytest.fixture
def gate(monkeypatch):
    """Holds every background write until the test opens the gate (opened at teardown)."""
    opened = threading.Event()
    real = os.pwrite

    def pwrite(fd, data, offset):
        if threading.current_thread() is not threading.main_thread():
            assert opened.wait(30)
        return real(fd, data, offset)

    monkeypatch.setattr(os, "pwrite", pwrite)
    yield opened
    opened.set()
