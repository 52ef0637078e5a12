"""Where checkpoints live: a local directory or an object-store URL.

`locate(path)` turns what the user passed into a `Location`:

- a local path, or a `file://` URL: a `pathlib.Path`, written with the POSIX code in
  writer.py/commit.py (pwrite, fsync, rename) and read with pread;
- `s3://bucket/prefix` and `gs://bucket/prefix`: an `ObjectStore`, backed by
  tensorstore's kvstore drivers (tensorstore is what Orbax itself reads and writes
  through, so it is there wherever Orbax checkpoints are; fsspec would need s3fs and
  gcsfs, two more dependency trees, for the same requests);
- any other `scheme://`: a CheckpointError. A URL is never taken for a local folder.

Object stores have no rename, so the commit is the layout: data objects are written
under names no committed layout refers to, and `layout.pb` is written last, with one
PUT (atomic on S3 and GCS). A prefix without `layout.pb` is not a checkpoint.
"""

from __future__ import annotations

import os
import pathlib
import re
import urllib.parse
from collections.abc import Iterable
from typing import Any

from fcir.errors import CheckpointError

_URL = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://(.*)$", re.S)
#: What a URL collapses to when it went through pathlib ("gs://b/c" -> "gs:/b/c").
_MANGLED = re.compile(r"^(s3|gs|gcs|file|memory|https?|az|abfs)s?:/[^/]", re.I)
SCHEMES = ("s3", "gs", "file")

#: Fewer retries than tensorstore's default (32, with backoff up to a minute), so an
#: unreachable endpoint is an error within seconds rather than after many minutes.
_RETRIES = {"max_retries": 6, "initial_delay": "0.2s", "max_delay": "4s"}


class ObjectStore:
    """A checkpoint prefix in an object store: keys relative to `url` ("a/b.bin")."""

    def __init__(self, scheme: str, bucket: str, prefix: str) -> None:
        self.scheme, self.bucket = scheme, bucket
        self.prefix = prefix.strip("/")
        self._kv: Any = None

    @property
    def url(self) -> str:
        return f"{self.scheme}://{self.bucket}/{self.prefix}".rstrip("/")

    @property
    def name(self) -> str:
        return self.prefix.rsplit("/", 1)[-1] if self.prefix else self.bucket

    def __str__(self) -> str:
        return self.url

    def __repr__(self) -> str:
        return f"ObjectStore({self.url!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ObjectStore) and other.url == self.url

    def __hash__(self) -> int:
        return hash(self.url)

    def __truediv__(self, name: str) -> ObjectStore:
        return ObjectStore(self.scheme, self.bucket, f"{self.prefix}/{name}".strip("/"))

    # -- the kvstore ---------------------------------------------------------------------

    def _spec(self) -> dict[str, Any]:
        path = self.prefix + "/" if self.prefix else ""
        if self.scheme == "s3":
            spec: dict[str, Any] = {"driver": "s3", "bucket": self.bucket, "path": path}
            endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
            region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
            if endpoint:
                spec["endpoint"] = endpoint
                region = region or "us-east-1"
            if region:
                spec["aws_region"] = region
            spec["aws_credentials"] = {"type": _aws_credentials(self.url)}
            spec["context"] = {"s3_request_retries": _RETRIES}
            return spec
        _check_google_credentials(self.url)
        return {
            "driver": "gcs",
            "bucket": self.bucket,
            "path": path,
            "context": {"gcs_request_retries": _RETRIES},
        }

    def kvstore_spec(self) -> dict[str, Any]:
        """The tensorstore kvstore spec of this prefix (for drivers that take one)."""
        return self._spec()

    def kv(self) -> Any:
        if self._kv is None:
            ts = _tensorstore()
            spec = self._spec()  # CheckpointError for missing credentials, as it is
            try:
                self._kv = ts.KvStore.open(spec).result()
            except Exception as e:  # tensorstore raises ValueError with its status text
                raise CheckpointError(f"cannot open {self.url}: {e}") from e
        return self._kv

    def _call(self, what: str, run: Any) -> Any:
        try:
            return run()
        except CheckpointError:
            raise
        except Exception as e:  # ValueError/OSError with tensorstore's status text
            raise CheckpointError(f"{what} {self.url}: {_cause(self.scheme, str(e))}{e}") from e

    def read(self, key: str, start: int | None = None, stop: int | None = None) -> bytes | None:
        """The object's bytes [start, stop), or None when it does not exist."""
        kv = self.kv()

        def run() -> bytes | None:
            if start is None and stop is None:
                got = kv.read(key).result()
            else:
                got = kv.read(key, byte_range=slice(start, stop)).result()
            return None if got.state == "missing" else got.value

        return self._call(f"reading {key} of", run)

    def write(self, key: str, data: bytes | bytearray | memoryview) -> None:
        """Stores `data` under `key` (one PUT; durable when this returns)."""
        self.write_many([(key, data)])

    def write_many(self, objects: Iterable[tuple[str, bytes | bytearray | memoryview]]) -> None:
        """Stores every object, with their requests in flight concurrently."""
        kv = self.kv()

        def run() -> None:
            futures = [kv.write(k, bytes(v)) for k, v in objects]
            for f in futures:
                f.result()

        self._call("writing to", run)

    def exists(self, key: str) -> bool:
        return self.read(key, 0, 0) is not None

    def list(self, under: str = "") -> list[str]:
        """Every key that starts with `under`, sorted."""
        kv = self.kv()
        ts = _tensorstore()

        def run() -> list[str]:
            rng = ts.KvStore.KeyRange(under.encode(), _successor(under)) if under else None
            return sorted(k.decode() for k in kv.list(rng).result())

        return self._call("listing", run)

    def delete(self, keys: Iterable[str]) -> None:
        kv = self.kv()

        def run() -> None:
            futures = [kv.write(k, None) for k in keys]
            for f in futures:
                f.result()

        self._call("deleting from", run)

    def delete_under(self, under: str) -> None:
        """Deletes every key that starts with `under` ("" for the whole prefix)."""
        kv = self.kv()
        ts = _tensorstore()
        rng = (
            ts.KvStore.KeyRange(under.encode(), _successor(under))
            if under
            else ts.KvStore.KeyRange()
        )
        self._call("deleting from", lambda: kv.delete_range(rng).result())


Location = pathlib.Path | ObjectStore


def locate(path: str | os.PathLike[str] | ObjectStore) -> Location:
    """The checkpoint location `path` names; CheckpointError for a URL fcir cannot reach."""
    if isinstance(path, ObjectStore):
        return path
    text = os.fspath(path)
    if isinstance(text, bytes):
        text = os.fsdecode(text)
    m = _URL.match(text)
    if m is None:
        if _MANGLED.match(text):
            raise CheckpointError(
                f"{text!r} looks like a URL that lost a slash (pathlib.Path turns 'gs://b' "
                "into 'gs:/b'); pass the URL as a str"
            )
        return pathlib.Path(os.path.abspath(text))
    scheme, rest = m.group(1).lower(), m.group(2)
    if scheme == "file":
        parsed = urllib.parse.urlparse(text)
        if parsed.netloc not in ("", "localhost"):
            raise CheckpointError(f"{text}: file:// URLs must name a local path (file:///dir)")
        return pathlib.Path(os.path.abspath(urllib.parse.unquote(parsed.path)))
    if scheme in ("s3", "gs"):
        bucket, _, prefix = rest.partition("/")
        if not bucket:
            raise CheckpointError(f"{text}: the URL names no bucket ({scheme}://BUCKET/PATH)")
        return ObjectStore(scheme, bucket, prefix)
    raise CheckpointError(
        f"{text}: no checkpoint storage for {scheme}:// URLs; use a local path, file://, "
        "s3:// or gs://"
    )


def display(location: Location) -> str:
    return str(location)


def _successor(prefix: str) -> bytes:
    """The smallest key after every key that starts with `prefix` (keys are ASCII)."""
    raw = prefix.encode()
    return raw[:-1] + bytes([raw[-1] + 1])


def _tensorstore() -> Any:
    try:
        import tensorstore
    except ImportError as e:
        raise CheckpointError(
            "checkpoints in object stores need tensorstore: pip install -e '.[storage]' in "
            "the fcir checkout (or pip install 'tensorstore>=0.1.71')"
        ) from e
    return tensorstore


def _aws_credentials(url: str) -> str:
    """The tensorstore credentials provider for AWS's standard sources, or an error.

    Checked here because with no source tensorstore keeps retrying the instance
    metadata service, which on a machine that is not in AWS never answers.
    """
    env = os.environ
    if env.get("AWS_ACCESS_KEY_ID") and env.get("AWS_SECRET_ACCESS_KEY"):
        return "environment"
    home = pathlib.Path.home()
    files = [
        env.get("AWS_SHARED_CREDENTIALS_FILE") or home / ".aws" / "credentials",
        env.get("AWS_CONFIG_FILE") or home / ".aws" / "config",
    ]
    if (
        any(os.path.isfile(f) for f in files)
        or env.get("AWS_WEB_IDENTITY_TOKEN_FILE")
        or env.get("AWS_CONTAINER_CREDENTIALS_RELATIVE_URI")
        or env.get("AWS_CONTAINER_CREDENTIALS_FULL_URI")
        or _vendor_is("Amazon")
    ):
        return "default"
    raise CheckpointError(
        f"{url}: no AWS credentials: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or "
        "AWS_PROFILE with ~/.aws/credentials, or run where an instance or container role "
        "provides them (AWS_ENDPOINT_URL points at another S3-compatible server)"
    )


def _check_google_credentials(url: str) -> None:
    env = os.environ
    adc = pathlib.Path.home() / ".config" / "gcloud" / "application_default_credentials.json"
    if (
        env.get("GOOGLE_APPLICATION_CREDENTIALS")
        or env.get("TENSORSTORE_GCS_HTTP_URL")  # an emulator: no credentials needed
        or adc.is_file()
        or _vendor_is("Google")
    ):
        return
    raise CheckpointError(
        f"{url}: no Google Cloud credentials: set GOOGLE_APPLICATION_CREDENTIALS to a "
        "service-account key file, run `gcloud auth application-default login`, or run on "
        "Google Cloud"
    )


def _vendor_is(name: str) -> bool:
    """Whether the machine's firmware names `name` (how cloud SDKs detect their VMs)."""
    for f in ("/sys/class/dmi/id/product_name", "/sys/class/dmi/id/sys_vendor"):
        try:
            if name in pathlib.Path(f).read_text():
                return True
        except OSError:
            pass
    return False


def _cause(scheme: str, status: str) -> str:
    """What a tensorstore status means for the user, where its text does not say.

    A refused signature comes back as "PERMISSION_DENIED: Unknown [http_response_code=
    '403']" for reads, which reads like a bucket policy problem even when the key is
    simply wrong.
    """
    if status.startswith("PERMISSION_DENIED"):
        where = (
            "AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, AWS_PROFILE"
            if scheme == "s3"
            else "GOOGLE_APPLICATION_CREDENTIALS, gcloud's login"
        )
        return (
            "access denied: the server refused the credentials or they lack permission "
            f"for this bucket (check {where}); "
        )
    if "Could not connect" in status or "Could not resolve" in status:
        return "the endpoint cannot be reached; "
    return ""
