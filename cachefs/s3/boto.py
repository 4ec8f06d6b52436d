"""An :class:`~cachefs.s3.store.ObjectStore` on boto3 (HEAD, the mount probe).

GETs, listings (:mod:`cachefs.s3.listxml` parses them), checksum HEADs and
the bucket-region lookup take the lean path (:mod:`cachefs.s3.ranges`, see
there for why); boto3/botocore stays inside this package.

Region: requests are signed for ``region`` (default: the node's AWS
config). The daemon asks :meth:`S3Store.bucket_region` at mount and, unless
``--region`` was given, builds the store again for the bucket's own region
(:meth:`S3Store.for_region`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from cachefs import metrics
from cachefs.errors import StoreError, TransientStoreError
from cachefs.s3.credentials import FileCredentials
from cachefs.s3.errors import translate_botocore
from cachefs.s3.integrity import Checksum
from cachefs.s3.ranges import RangeClient
from cachefs.s3.store import Body, Exchange, ListPage, ObjectInfo

log = logging.getLogger(__name__)


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
        self._args: dict[str, Any] = dict(
            endpoint_url=endpoint_url, max_connections=max_connections, anonymous=anonymous,
            connect_timeout=connect_timeout, read_timeout=read_timeout)
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
        self.region: str = self._client.meta.region_name
        credentials = None if anonymous else session.get_credentials()
        if credentials is not None:  # (renewed in their file, they are picked up: see there)
            credentials = FileCredentials(session._session, credentials)
            self._client._request_signer._credentials = credentials
        # GETs take the lean data path (see cachefs.s3.ranges for why and the numbers).
        try:  # AWS_CA_BUNDLE or the profile's ca_bundle, as botocore itself uses
            ca_bundle = session._session.get_config_variable("ca_bundle")
        except Exception:
            ca_bundle = None
        self._ranges = RangeClient(
            bucket, endpoint_url=self._client.meta.endpoint_url, region=self.region,
            credentials=credentials, anonymous=anonymous,
            max_connections=max_connections, connect_timeout=connect_timeout,
            read_timeout=read_timeout, ca_bundle=ca_bundle)

    def prewarm(self, n: int) -> int:
        """Open ``n`` data-path connections ahead of the first GETs (see
        :meth:`RangeClient.prewarm`); blocking. Returns how many were opened."""
        return self._ranges.prewarm(n)

    def for_region(self, region: str) -> S3Store:
        """The same store, signing for ``region`` (endpoints follow it on AWS)."""
        return S3Store(self.bucket, region=region, **self._args)

    @property
    def endpoint(self) -> str:
        """The endpoint URL in use, with the proxy in between if any (for logs)."""
        via = self._ranges.connector.via_proxy
        url: str = self._client.meta.endpoint_url
        return f"{url} via proxy {via}" if via else url

    def bucket_region(self) -> str | None:
        """The bucket's region as S3 states it (None if it does not say). Raises the
        errors of list_page."""
        return self._ranges.bucket_region()

    def in_bucket_region(self) -> S3Store:
        """This store, or the same one signing for the bucket's own region when S3 names
        another (what the mount and the CLI tools do unless ``--region`` was given). A
        failed lookup keeps this store: the request that follows reports what is wrong."""
        try:
            region = self.bucket_region()
        except StoreError as exc:
            log.debug("bucket region lookup failed: %s", exc)
            return self
        if not region or region == self.region:
            return self
        log.info("bucket %s is in %s: signing requests for it (the AWS config says %s)",
                 self.bucket, region, self.region)
        return self.for_region(region)

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
                  start_after: str | None = None, exchange: Exchange | None = None, *,
                  flat: bool = False) -> ListPage:
        # The lean client: signed like the GETs, parsed by ElementTree's C accelerator
        # (cachefs.s3.listxml has the numbers against botocore's parser).
        return self._ranges.list_page(prefix, token, start_after=start_after,
                                      exchange=exchange, delimiter="" if flat else "/")

    def probe(self, prefix: str) -> bool:
        """One cheap request (a one-key listing) proving the bucket exists and the
        credentials may list it; whether any key starts with ``prefix``. Raises the errors
        of list_page, and a StoreError if the answer is not S3's (a web page: botocore
        finds no fields in it and says nothing)."""
        answer = self._call("list", self._client.list_objects_v2, Bucket=self.bucket,
                            Prefix=prefix, MaxKeys=1)
        if "IsTruncated" not in answer:  # (every ListBucketResult has it)
            headers = answer.get("ResponseMetadata", {}).get("HTTPHeaders", {})
            kind = headers.get("content-type") or "no content type"
            raise StoreError(f"the endpoint answered a listing with {kind}, not an S3 listing "
                             "(is --endpoint-url the address of the S3 API?)")
        return bool(answer.get("KeyCount") or answer.get("Contents"))

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

    def get(self, key: str, etag: str, start: int, end: int, *, whole: bool = False,
            exchange: Exchange | None = None, md5: bool = False) -> Body:
        if end <= start:
            return Body(b"")
        return self._ranges.get(key, etag, start, end, whole=whole, exchange=exchange,
                               md5=md5)

    def full_checksum(self, key: str, etag: str,
                      exchange: Exchange | None = None) -> Checksum | None:
        return self._ranges.full_checksum(key, etag, exchange)
