"""The S3 data plane: ranged GETs over plain ``http.client`` connections.

Why not boto3 for GETs: measured on this project's machines, a boto3
``get_object`` of a 110 KB object costs 1.5-4.5 ms of CPU (request model,
event hooks, response parsing) against ~0.8 ms for the same request signed
with botocore's SigV4 signer and sent on a kept-alive ``http.client``
connection (awscrt's S3 client: ~1.0 ms). For datasets of small files the
daemon's CPU per file is the limit on 2 cores, so GETs take the lean path,
and so do listings (:func:`RangeClient.list_page`, parsed by
:mod:`cachefs.s3.listxml`); HEAD and the mount probe stay on boto3
(:mod:`cachefs.s3.boto`). See
benchmarks/RESULTS.md for the numbers.

Thread-safety: a :class:`RangeClient` is shared by worker threads; each
request takes an idle connection from a LIFO pool (or opens one) and returns
it only after a complete, successful response. Credentials are read per
request (``get_frozen_credentials``) so refreshed instance-role credentials
are picked up.
"""

from __future__ import annotations

import http.client
import queue
import re
import socket
import ssl
import time
import urllib.parse
from typing import Any

from botocore.auth import S3SigV4Auth
from botocore.awsrequest import AWSRequest

from cachefs import metrics
from cachefs.errors import (
    CredentialsError,
    EndpointUnreachable,
    ObjectChanged,
    StoreError,
    TransientStoreError,
)
from cachefs.s3.errors import NO_CREDENTIALS, error_for_response
from cachefs.s3.listxml import parse_list_page
from cachefs.s3.store import ListPage

_CODE_RE = re.compile(rb"<Code>([^<]+)</Code>")


class RangeClient:
    """Signed ranged GETs of one bucket."""

    def __init__(self, bucket: str, *, endpoint_url: str, region: str, credentials: Any,
                 anonymous: bool, max_connections: int, connect_timeout: float,
                 read_timeout: float) -> None:
        self.bucket = bucket
        url = urllib.parse.urlsplit(endpoint_url)
        self._https = url.scheme == "https"
        host = url.hostname or ""
        # AWS endpoints: virtual-hosted style (path style is deprecated there);
        # other S3-compatible servers: path style, as boto3 does with an endpoint URL.
        virtual = host.endswith(".amazonaws.com") and "." not in bucket
        self._host = f"{bucket}.{host}" if virtual else host
        self._port = url.port or (443 if self._https else 80)
        netloc = self._host if url.port is None else f"{self._host}:{url.port}"
        self._base = f"{url.scheme}://{netloc}"
        self._path_prefix = "" if virtual else "/" + urllib.parse.quote(bucket)
        self._region = region
        self._credentials = credentials
        self._anonymous = anonymous
        self._connect_timeout = connect_timeout
        self._read_timeout = read_timeout
        self._pool: queue.LifoQueue[http.client.HTTPConnection] = queue.LifoQueue(
            maxsize=max_connections)
        self._ssl = ssl.create_default_context() if self._https else None

    # -- connections ------------------------------------------------------------
    def _connect(self) -> http.client.HTTPConnection:
        try:
            return self._pool.get_nowait()
        except queue.Empty:
            pass
        conn: http.client.HTTPConnection
        if self._https:
            conn = http.client.HTTPSConnection(self._host, self._port,
                                               timeout=self._connect_timeout, context=self._ssl)
        else:
            conn = http.client.HTTPConnection(self._host, self._port,
                                              timeout=self._connect_timeout)
        try:
            conn.connect()
        except (OSError, http.client.HTTPException) as exc:
            conn.close()
            raise EndpointUnreachable(f"cannot connect to {self._base}: {exc}") from exc
        assert conn.sock is not None
        conn.sock.settimeout(self._read_timeout)  # a stalled response fails, then is retried
        conn.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return conn

    def _release(self, conn: http.client.HTTPConnection) -> None:
        try:
            self._pool.put_nowait(conn)
        except queue.Full:
            conn.close()

    # -- requests -----------------------------------------------------------------
    def _headers(self, path: str, extra: dict[str, str]) -> dict[str, str]:
        request = AWSRequest("GET", self._base + path, headers=extra)
        if self._credentials is None and not self._anonymous:
            raise CredentialsError(NO_CREDENTIALS)
        if self._credentials is not None:
            frozen = self._credentials.get_frozen_credentials()
            S3SigV4Auth(frozen, "s3", self._region).add_auth(request)
        return {k: v for k, v in request.headers.items()}

    def _request(self, op: str, path: str, headers: dict[str, str],
                 where: str) -> tuple[int, bytes, str]:
        """Send one signed GET; returns (status, body, ETag header). Counts the request and
        its latency under ``op``; a connection failure is a TransientStoreError."""
        metrics.S3_REQUESTS.labels(op).inc()
        t0 = time.monotonic()
        conn: http.client.HTTPConnection | None = None
        try:
            conn = self._connect()
            conn.request("GET", path, headers=headers)
            resp = conn.getresponse()
            body = resp.read()
            status = resp.status
            got_etag = (resp.getheader("ETag") or "").strip('"')
            reusable = not resp.will_close
        except StoreError as exc:
            metrics.S3_ERRORS.labels(op, type(exc).__name__).inc()
            raise
        except (OSError, http.client.HTTPException) as exc:
            if conn is not None:
                conn.close()
            transient = TransientStoreError(f"{where}: connection problem: {exc!r}")
            metrics.S3_ERRORS.labels(op, "TransientStoreError").inc()
            raise transient from exc
        finally:
            metrics.S3_LATENCY.labels(op).observe(time.monotonic() - t0)
        if reusable:
            self._release(conn)
        else:
            conn.close()
        return status, body, got_etag

    def _fail(self, op: str, status: int, body: bytes, key: str | None) -> StoreError:
        err = self._error(status, body, key)
        metrics.S3_ERRORS.labels(op, type(err).__name__).inc()
        if isinstance(err, TransientStoreError) and err.throttled:
            metrics.S3_THROTTLES.labels(op).inc()
        return err

    def get_range(self, key: str, etag: str, start: int, end: int) -> bytes:
        """Bytes [start, end) of version ``etag`` of ``key``. Raises cachefs errors only."""
        path = self._path_prefix + "/" + urllib.parse.quote(key, safe="/~")
        headers = self._headers(path, {"Range": f"bytes={start}-{end - 1}",
                                       "If-Match": f'"{etag}"' if etag else "*"})
        status, body, got_etag = self._request("get", path, headers, f"s3://{self.bucket}/{key}")
        if status not in (200, 206):
            raise self._fail("get", status, body, key)
        if etag and got_etag and got_etag != etag:
            metrics.S3_ERRORS.labels("get", "ObjectChanged").inc()
            raise ObjectChanged(f"s3://{self.bucket}/{key} changed (ETag {got_etag}, "
                                f"expected {etag})")
        if status == 200 and (start > 0 or len(body) > end - start):
            body = body[start:end]  # a server that ignored Range sent the whole object
        if len(body) != end - start:
            metrics.S3_ERRORS.labels("get", "ShortRead").inc()
            raise TransientStoreError(f"s3://{self.bucket}/{key}: got {len(body)} bytes for "
                                      f"range {start}-{end - 1}")
        metrics.S3_BYTES.inc(len(body))
        return body

    def list_page(self, prefix: str, token: str | None, *, delimiter: str = "/",
                  max_keys: int = 1000, start_after: str | None = None) -> ListPage:
        """One page of ListObjectsV2, parsed by :mod:`cachefs.s3.listxml` (see there for
        why not boto3). Raises cachefs errors only."""
        params = {"list-type": "2", "prefix": prefix, "encoding-type": "url",
                  "max-keys": str(max_keys)}
        if delimiter:
            params["delimiter"] = delimiter
        if token:
            params["continuation-token"] = token
        if start_after:
            params["start-after"] = start_after
        # SigV4 signs the query as sent: strict RFC 3986 encoding, sorted names.
        query = "&".join(f"{k}={urllib.parse.quote(v, safe='-_.~')}"
                         for k, v in sorted(params.items()))
        path = (self._path_prefix or "") + "/?" + query
        headers = self._headers(path, {})
        status, body, _ = self._request("list", path, headers, f"s3://{self.bucket}/{prefix}")
        if status != 200:
            raise self._fail("list", status, body, None)
        return parse_list_page(body)

    def _error(self, status: int, body: bytes, key: str | None) -> StoreError:
        m = _CODE_RE.search(body)
        code = m.group(1).decode(errors="replace") if m else ""
        return error_for_response(status, code, self.bucket, key, f"HTTP {status}")
