"""Object stores: the one interface cachefs reads S3 through.

:class:`ObjectStore` is a *blocking* protocol: implementations are called from
worker threads (never from the trio thread; see :mod:`cachefs.read.fetcher` and
:mod:`cachefs.cache.metadata`). Every method raises only :mod:`cachefs.errors`
types; boto3/botocore stays inside this module.

Implementations:

* :class:`S3Store` -- boto3, with metrics per request attempt.
* :class:`RetryingStore` -- wraps any store; retries ``TransientStoreError``
  with exponential backoff and full jitter.
* :class:`MemoryStore` -- a dict; shipped code for unit tests and examples,
  with counters and a hook for injected faults.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import random
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, Protocol

from cachefs import metrics
from cachefs.errors import (
    AccessDenied,
    CredentialsError,
    EndpointUnreachable,
    NoSuchBucket,
    NoSuchKey,
    ObjectChanged,
    StoreError,
    TransientStoreError,
)

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True, slots=True)
class ObjectInfo:
    """One object version: identity is (key, etag)."""

    key: str
    size: int
    etag: str
    mtime: float  # seconds since the epoch (LastModified)


@dataclasses.dataclass(slots=True)
class ListPage:
    """One page of a delimiter listing: objects directly under the prefix and sub-prefixes."""

    objects: list[ObjectInfo]
    prefixes: list[str]
    next_token: str | None = None


def list_dir(store: ObjectStore, prefix: str) -> Iterator[ListPage]:
    """Every page of a delimiter listing of ``prefix``, in order."""
    token: str | None = None
    while True:
        page = store.list_page(prefix, token)
        yield page
        if not page.next_token:
            return
        token = page.next_token


class ObjectStore(Protocol):
    """Read access to one bucket. All methods block; call them from worker threads."""

    bucket: str

    def list_page(self, prefix: str, token: str | None) -> ListPage:
        """One page of ListObjectsV2 with Delimiter='/' under ``prefix``.

        ``token`` is None for the first page, then the previous page's ``next_token``.
        Raises NoSuchBucket, AccessDenied, CredentialsError, TransientStoreError.
        """
        ...

    def head(self, key: str) -> ObjectInfo:
        """HEAD one object. Raises NoSuchKey and the errors of list_dir."""
        ...

    def get_range(self, key: str, etag: str, start: int, end: int) -> bytes:
        """Bytes ``[start, end)`` of version ``etag`` of ``key`` (If-Match).

        Raises ObjectChanged when the object is no longer that version, NoSuchKey
        when it is gone, and the errors of list_dir. Returns exactly end-start bytes.
        """
        ...


NO_CREDENTIALS = ("no AWS credentials found (set AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, a "
                  "profile, or an instance role; or use --no-sign-request for a public bucket)")


def _strip_etag(etag: str) -> str:
    return etag.strip('"')


class S3Store:
    """An :class:`ObjectStore` on boto3. Thread-safe (one boto3 client shared by threads)."""

    def __init__(
        self,
        bucket: str,
        *,
        endpoint_url: str | None = None,
        region: str | None = None,
        max_connections: int = 64,
        anonymous: bool = False,
        connect_timeout: float = 5.0,
        read_timeout: float = 30.0,
    ) -> None:
        import boto3
        import botocore.config
        from botocore import UNSIGNED

        self.bucket = bucket
        cfg_args: dict[str, Any] = dict(
            max_pool_connections=max_connections,
            connect_timeout=connect_timeout,
            # A stalled response is dropped after this long without a byte
            # (Mountpoint uses 30 s); the retry layer then tries again.
            read_timeout=read_timeout,
            # Retries are ours (RetryingStore) so that every attempt is counted.
            retries={"total_max_attempts": 1, "mode": "standard"},
            # boto3 >= 1.36 checksums break some S3-compatible servers.
            request_checksum_calculation="when_required",
            response_checksum_validation="when_required",
            tcp_keepalive=True,
        )
        if anonymous:
            cfg_args["signature_version"] = UNSIGNED
        session = boto3.session.Session()
        self._client = session.client(
            "s3",
            endpoint_url=endpoint_url,
            region_name=region or session.region_name or "us-east-1",
            config=botocore.config.Config(**cfg_args),
        )
        # GETs take the lean data path (see cachefs.s3.ranges for why and the numbers).
        from cachefs.s3.ranges import RangeClient

        self._ranges = RangeClient(
            bucket, endpoint_url=self._client.meta.endpoint_url,
            region=self._client.meta.region_name,
            credentials=None if anonymous else session.get_credentials(), anonymous=anonymous,
            max_connections=max_connections, connect_timeout=connect_timeout,
            read_timeout=read_timeout)

    # -- requests ------------------------------------------------------------
    def _call(self, op: str, fn: Callable[..., Any], **kwargs: Any) -> Any:
        metrics.S3_REQUESTS.labels(op).inc()
        t0 = time.monotonic()
        try:
            return fn(**kwargs)
        except Exception as exc:
            err = _translate(exc, self.bucket, kwargs.get("Key"))
            metrics.S3_ERRORS.labels(op, type(err).__name__).inc()
            if isinstance(err, TransientStoreError) and err.throttled:
                metrics.S3_THROTTLES.labels(op).inc()
            raise err from exc
        finally:
            metrics.S3_LATENCY.labels(op).observe(time.monotonic() - t0)

    def list_page(self, prefix: str, token: str | None) -> ListPage:
        kwargs: dict[str, Any] = {"Bucket": self.bucket, "Prefix": prefix, "Delimiter": "/"}
        if token:
            kwargs["ContinuationToken"] = token
        resp = self._call("list", self._client.list_objects_v2, **kwargs)
        objects = [
            ObjectInfo(
                key=o["Key"],
                size=int(o["Size"]),
                etag=_strip_etag(o.get("ETag", "")),
                mtime=o["LastModified"].timestamp(),
            )
            for o in resp.get("Contents", ())
        ]
        prefixes = [p["Prefix"] for p in resp.get("CommonPrefixes", ())]
        next_token = resp.get("NextContinuationToken") if resp.get("IsTruncated") else None
        return ListPage(objects, prefixes, next_token or None)

    def probe(self, prefix: str) -> None:
        """One cheap request (a one-key listing) proving the bucket exists and the
        credentials may list it. Raises the errors of list_page."""
        self._call("list", self._client.list_objects_v2, Bucket=self.bucket, Prefix=prefix,
                   MaxKeys=1)

    def head(self, key: str) -> ObjectInfo:
        resp = self._call("head", self._client.head_object, Bucket=self.bucket, Key=key)
        return ObjectInfo(key, int(resp["ContentLength"]), _strip_etag(resp.get("ETag", "")),
                          resp["LastModified"].timestamp())

    def get_range(self, key: str, etag: str, start: int, end: int) -> bytes:
        if end <= start:
            return b""
        return self._ranges.get_range(key, etag, start, end)


def error_for_response(status: int, code: str, bucket: str, key: str | None,
                       message: str = "") -> StoreError:
    """The cachefs error for an S3 error response (HTTP status and S3 error code).
    The one mapping for both clients (boto3 here, the lean GET client in s3http)."""
    where = f"s3://{bucket}/{key}" if key else f"s3://{bucket}"
    if code == "NoSuchBucket":
        return NoSuchBucket(f"bucket {bucket!r} does not exist")
    if code in ("NoSuchKey", "404", "NotFound") or (status == 404 and key):
        return NoSuchKey(f"{where} does not exist")
    if status == 404:
        return NoSuchBucket(f"bucket {bucket!r} does not exist")
    if code in ("PreconditionFailed", "412") or status == 412:
        return ObjectChanged(f"{where} changed since it was opened")
    if code in ("InvalidAccessKeyId", "SignatureDoesNotMatch", "ExpiredToken",
                "InvalidToken", "TokenRefreshRequired"):
        return CredentialsError(f"the S3 endpoint rejected the credentials ({code})")
    if code in ("AccessDenied", "AllAccessDisabled") or status == 403:
        return AccessDenied(f"access denied to {where}")
    if code in ("SlowDown", "Throttling", "ThrottlingException", "RequestLimitExceeded",
                "TooManyRequests") or status in (429, 503):
        return TransientStoreError(f"{where}: throttled ({code or status})", throttled=True)
    if status >= 500 or code in ("InternalError", "ServiceUnavailable", "RequestTimeout"):
        return TransientStoreError(f"{where}: server error {status} {code}")
    return StoreError(f"{where}: {code or status}: {message or 'request failed'}")


def _translate(exc: Exception, bucket: str, key: str | None) -> StoreError:
    """Map a botocore exception to the cachefs error hierarchy."""
    from botocore import exceptions as bex

    where = f"s3://{bucket}/{key}" if key else f"s3://{bucket}"
    if isinstance(exc, StoreError):
        return exc
    if isinstance(exc, bex.NoCredentialsError):
        return CredentialsError(NO_CREDENTIALS)
    if isinstance(exc, (bex.EndpointConnectionError, bex.ConnectTimeoutError)):
        return EndpointUnreachable(f"cannot connect to the S3 endpoint: {exc}")
    if isinstance(exc, (bex.ReadTimeoutError, bex.ConnectionClosedError,
                        bex.IncompleteReadError, bex.ResponseStreamingError,
                        bex.HTTPClientError)):
        return TransientStoreError(f"{where}: connection problem: {exc}")
    if isinstance(exc, bex.ClientError):
        err = exc.response.get("Error", {})
        status = int(exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) or 0)
        return error_for_response(status, str(err.get("Code", "")), bucket, key,
                                  str(err.get("Message", exc)))
    if isinstance(exc, bex.BotoCoreError):
        return StoreError(f"{where}: {exc}")
    if isinstance(exc, (ConnectionError, TimeoutError)):
        return TransientStoreError(f"{where}: {exc}")
    return StoreError(f"{where}: unexpected {type(exc).__name__}: {exc}")


@dataclasses.dataclass(frozen=True)
class RetryPolicy:
    """Exponential backoff with full jitter: sleep U(0, min(cap, base * 2**n))."""

    attempts: int = 8
    base: float = 0.2
    cap: float = 10.0

    def delay(self, attempt: int) -> float:
        return random.uniform(0, min(self.cap, self.base * (2 ** attempt)))


class RetryingStore:
    """Retries transient failures of an inner store. Sleeps in the calling worker thread."""

    def __init__(self, inner: ObjectStore, policy: RetryPolicy | None = None,
                 sleep: Callable[[float], None] = time.sleep) -> None:
        self.inner = inner
        self.bucket = inner.bucket
        self.policy = policy or RetryPolicy()
        self._sleep = sleep

    def _retry(self, op: str, fn: Callable[[], Any]) -> Any:
        for attempt in range(self.policy.attempts):
            try:
                return fn()
            except TransientStoreError as exc:
                if attempt + 1 >= self.policy.attempts:
                    raise
                delay = self.policy.delay(attempt)
                metrics.S3_RETRIES.labels(op).inc()
                log.warning("S3 %s failed (%s); retry %d/%d in %.2fs", op, exc, attempt + 1,
                            self.policy.attempts - 1, delay)
                self._sleep(delay)
        raise AssertionError("unreachable")

    def list_page(self, prefix: str, token: str | None) -> ListPage:
        return self._retry(  # type: ignore[no-any-return]
            "list", lambda: self.inner.list_page(prefix, token))

    def head(self, key: str) -> ObjectInfo:
        return self._retry("head", lambda: self.inner.head(key))  # type: ignore[no-any-return]

    def get_range(self, key: str, etag: str, start: int, end: int) -> bytes:
        return self._retry(  # type: ignore[no-any-return]
            "get", lambda: self.inner.get_range(key, etag, start, end))


class MemoryStore:
    """An in-memory :class:`ObjectStore` for unit tests. Thread-safe.

    ``fault`` may be set to a callable ``(op, key) -> None`` that raises to inject
    failures. ``calls`` counts requests per operation.
    """

    def __init__(self, bucket: str = "bucket", page_size: int = 1000) -> None:
        self.bucket = bucket
        self.page_size = page_size
        self._objects: dict[str, tuple[bytes, ObjectInfo]] = {}
        self._lock = threading.Lock()
        self.calls: dict[str, int] = {"list": 0, "head": 0, "get": 0}
        self.fault: Callable[[str, str], None] | None = None

    def put(self, key: str, data: bytes, mtime: float | None = None) -> ObjectInfo:
        info = ObjectInfo(key, len(data), hashlib.md5(data).hexdigest(),
                          time.time() if mtime is None else mtime)
        with self._lock:
            self._objects[key] = (data, info)
        return info

    def delete(self, key: str) -> None:
        with self._lock:
            self._objects.pop(key, None)

    def _count(self, op: str, key: str) -> None:
        with self._lock:
            self.calls[op] += 1
        if self.fault is not None:
            self.fault(op, key)

    def list_page(self, prefix: str, token: str | None) -> ListPage:
        self._count("list", prefix)
        with self._lock:
            keys = sorted(k for k in self._objects if k.startswith(prefix))
            infos = {k: self._objects[k][1] for k in keys}
        entries: list[tuple[str, ObjectInfo | None]] = []
        seen_prefixes: set[str] = set()
        for k in keys:
            rest = k[len(prefix):]
            slash = rest.find("/")
            if slash >= 0:
                p = prefix + rest[:slash + 1]
                if p not in seen_prefixes:
                    seen_prefixes.add(p)
                    entries.append((p, None))
            else:
                entries.append((k, infos[k]))
        start = int(token) if token else 0
        chunk = entries[start:start + self.page_size]
        more = start + self.page_size < len(entries)
        return ListPage([info for _, info in chunk if info is not None],
                        [p for p, info in chunk if info is None],
                        str(start + self.page_size) if more else None)

    def head(self, key: str) -> ObjectInfo:
        self._count("head", key)
        with self._lock:
            if key not in self._objects:
                raise NoSuchKey(f"s3://{self.bucket}/{key} does not exist")
            return self._objects[key][1]

    def get_range(self, key: str, etag: str, start: int, end: int) -> bytes:
        self._count("get", key)
        with self._lock:
            if key not in self._objects:
                raise NoSuchKey(f"s3://{self.bucket}/{key} does not exist")
            data, info = self._objects[key]
        if etag and info.etag != etag:
            raise ObjectChanged(f"s3://{self.bucket}/{key} changed since it was opened")
        return data[start:end]
