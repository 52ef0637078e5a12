"""A local S3 server (moto_server) for the object-store tests, started and stopped here."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator

from ckpt_testing import free_port

BUCKET = "fcir-ckpt"
CREDENTIALS = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_REGION": "us-east-1",
}


@contextlib.contextmanager
def moto_server(**env: str) -> Iterator[str]:
    """Runs `moto_server` on 127.0.0.1 (with `env` added to its environment); yields its
    endpoint URL; stops it afterwards."""
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env={**os.environ, **env},
    )
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), 0.2).close()
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"moto_server did not start (exit {proc.poll()})") from None
                time.sleep(0.1)
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def s3_env(endpoint: str) -> dict[str, str]:
    return {**CREDENTIALS, "AWS_ENDPOINT_URL": endpoint}


def client(endpoint: str):  # type: ignore[no-untyped-def]
    import boto3

    return boto3.client(
        "s3",
        endpoint_url=endpoint,
        region_name="us-east-1",
        aws_access_key_id="testing",
        aws_secret_access_key="testing",
    )


def keys(endpoint: str, prefix: str) -> list[str]:
    pages = client(endpoint).get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=prefix)
    return sorted(o["Key"] for page in pages for o in page.get("Contents", []))


def child_s3_env(endpoint: str, base: dict[str, str]) -> dict[str, str]:
    return {**base, **s3_env(endpoint), "HOME": os.environ.get("HOME", "/tmp")}
