"""An :class:`~cachefs.s3.store.ObjectStore` on boto3 (HEAD, the mount probe).

GETs and listings take the lean path (:mod:`cachefs.s3.ranges`, see there and
:mod:`cachefs.s3.listxml` for why);
boto3/botocore stays inside this package.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from cachefs import metrics
from cachefs.errors import TransientStoreError
from cachefs.s3.errors import translate_botocore
from cachefs.s3.ranges import RangeClient
from cachefs.s3.store import ListPage, ObjectInfo


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
            err = translate_botocore(exc, self.bucket, kwargs.get("Key"))
            metrics.S3_ERRORS.labels(op, type(err).__name__).inc()
            if isinstance(err, TransientStoreError) and err.throttled:
                metrics.S3_THROTTLES.labels(op).inc()
            raise err from exc
        finally:
            metrics.S3_LATENCY.labels(op).observe(time.monotonic() - t0)

    def list_page(self, prefix: str, token: str | None,
                  start_after: str | None = None) -> ListPage:
        # The lean client: signed like the GETs, parsed by ElementTree's C accelerator
        # (cachefs.s3.listxml has the numbers against botocore's parser).
        return self._ranges.list_page(prefix, token, start_after=start_after)

    def probe(self, prefix: str) -> None:
        """One cheap request (a one-key listing) proving the bucket exists and the
        credentials may list it. Raises the errors of list_page."""
        self._call("list", self._client.list_objects_v2, Bucket=self.bucket, Prefix=prefix,
                   MaxKeys=1)

    def probe_bucket(self) -> None:
        """HeadBucket: the bucket exists and the credentials are accepted, without a
        listing (manifest mounts never list). Raises the errors of list_page."""
        self._call("head", self._client.head_bucket, Bucket=self.bucket)

    def head(self, key: str) -> ObjectInfo:
        resp = self._call("head", self._client.head_object, Bucket=self.bucket, Key=key)
        return ObjectInfo(key, int(resp["ContentLength"]), _strip_etag(resp.get("ETag", "")),
                          resp["LastModified"].timestamp())

    def get_range(self, key: str, etag: str, start: int, end: int) -> bytes:
        if end <= start:
            return b""
        return self._ranges.get_range(key, etag, start, end)
