"""Whole-object GET, PUT (optionally conditional), HEAD and DELETE on one bucket.

The client of the shared cache tier (:mod:`cachefs.read.shared`): a second S3
endpoint with its own region and credentials, possibly an S3 Express One Zone
directory bucket (session auth, see :mod:`cachefs.s3.express`). Built the way
:mod:`cachefs.s3.ranges` is (botocore's SigV4 signer, kept-alive
``http.client`` connections from a LIFO pool) because it is on the data path
too, but it stays small: the shared tier wants answers fast or not at all, so
there are no retries here and timeouts are short; the caller's circuit breaker
decides what a failure means.

Contracts (every method blocks; call from worker threads; raises only
:mod:`cachefs.errors` types):

* :meth:`get` -> :class:`Response` or None for a missing key (404).
* :meth:`head` -> the headers, or None for a missing key.
* :meth:`put` -> True when stored; with ``if_none_match`` False when the key
  already exists (412 PreconditionFailed) or a concurrent conditional write
  won (409 ConditionalRequestConflict).
* :meth:`delete` -> None (a missing key is not an error).

Directory buckets: requests are signed with the session's credentials
(``x-amz-s3session-token``); an answer saying the session expired or is
invalid drops the session and the request is sent once more with a new one.

Kept-alive connections: one taken from the pool that turns out dead (the store
restarted, or closed it after idling: a reset, a broken pipe, or a close before
any answer) is dropped and the request is sent once more on a new connection;
only that, so a store that is down still fails a request at once. (Every request
here may be sent twice: a PUT writes the same bytes, a lease's second write
finds the first and answers "taken", which costs a wait, never a wrong byte.)

Timeouts: ``connect_timeout`` bounds a connection attempt and every request's
``timeout`` (default ``read_timeout``) bounds each wait for the server (sending,
the answer's first byte, each later read): a store that stops answering fails
the request within that time, in the calling thread.

Payloads are sent unsigned (``UNSIGNED-PAYLOAD``, which S3, S3 Express and
SeaweedFS accept): hashing every block for the signature would cost the CPU of
a SHA-256 over each published block; the block's stamp (checked on every read,
see :mod:`cachefs.read.shared`) is what guards its content.

Connections are opened by :class:`cachefs.s3.connections.Connector`, as the
origin's are: proxies from ``HTTPS_PROXY``/``HTTP_PROXY``/``NO_PROXY`` and TLS
verified against ``AWS_CA_BUNDLE`` when set.

Thread-safety: as :class:`cachefs.s3.ranges.RangeClient`: connections are
taken from and returned to a LIFO pool; credentials are read per request.
"""

from __future__ import annotations

import dataclasses
import http.client
import logging
import queue
import re
import socket
import threading
import time
import urllib.parse
from collections.abc import Callable
from typing import Any

from botocore.auth import S3ExpressAuth, S3SigV4Auth
from botocore.awsrequest import AWSRequest
from botocore.credentials import Credentials

from cachefs import metrics
from cachefs.errors import (
    ConfigError,
    CredentialsError,
    EndpointUnreachable,
    StoreError,
    TransientStoreError,
)
from cachefs.s3 import express
from cachefs.s3.connections import Connector
from cachefs.s3.credentials import FileCredentials
from cachefs.s3.errors import NO_CREDENTIALS, error_for_response

_CODE_RE = re.compile(rb"<Code>([^<]+)</Code>")
_REGION_RE = re.compile(rb"<Region>([^<]+)</Region>")


class _UnsignedPayload:
    """A stand-in for botocore's client config: S3SigV4Auth reads ``s3`` from it and then
    signs the payload as UNSIGNED-PAYLOAD."""

    s3 = {"payload_signing_enabled": False}
_SESSION_ERRORS = ("ExpiredToken", "InvalidToken", "TokenRefreshRequired")

log = logging.getLogger(__name__)


class RequestTimeout(TransientStoreError):
    """The store did not answer within the request's timeout."""

    def __init__(self, message: str) -> None:
        super().__init__(message, reason="timeout")


@dataclasses.dataclass(frozen=True, slots=True)
class Response:
    body: bytes
    headers: dict[str, str]  # names lower-cased


class ObjectClient:
    """Signed whole-object requests to one bucket of one endpoint.

    ``credentials`` is a botocore credentials object (refreshable) or None
    (``anonymous`` then says whether that is intended). ``express`` turns on
    S3 Express session auth (default: on for directory-bucket names unless
    ``AWS_S3_DISABLE_EXPRESS_SESSION_AUTH`` is set); ``session_mode`` None asks for
    the most the policies allow (ReadWrite, else ReadOnly).
    """

    def __init__(self, bucket: str, *, endpoint_url: str, region: str, credentials: Any,
                 anonymous: bool = False, express_sessions: bool | None = None,
                 max_connections: int = 32, connect_timeout: float = 1.0,
                 read_timeout: float = 2.0, session_mode: str | None = None,
                 follow_region: bool = False,
                 endpoint_for: Callable[[str], str] | None = None) -> None:
        self.bucket = bucket
        self._connect_timeout = connect_timeout
        self._pool: queue.LifoQueue[http.client.HTTPConnection] = queue.LifoQueue(
            maxsize=max_connections)
        self._set_endpoint(endpoint_url)
        self.region = region
        # (``follow_region``: the region was not given, so the one S3 names when it refuses
        # a request signed for another is taken; the endpoint too when ``endpoint_for``
        # made it from the region)
        self._follow_region = follow_region
        self._endpoint_for = endpoint_for
        self._generation = 0  # (of the endpoint: connections to an earlier one are closed)
        self._moving = threading.Lock()
        self._credentials = credentials
        self._anonymous = anonymous
        self._read_timeout = read_timeout
        self._session_mode = session_mode
        if express_sessions is None:
            express_sessions = (express.is_directory_bucket(bucket)
                                and not express.session_auth_disabled())
        self.sessions = (express.ExpressSessions(self.create_session)
                         if express_sessions and not anonymous else None)

    def _set_endpoint(self, endpoint_url: str) -> None:
        url = urllib.parse.urlsplit(endpoint_url)
        if url.scheme not in ("http", "https") or not url.hostname:
            raise ValueError(f"bad endpoint URL {endpoint_url!r}")
        self._https = url.scheme == "https"
        host = url.hostname
        # AWS endpoints: virtual-hosted style (the only style directory buckets accept);
        # other S3-compatible servers: path style, as boto3 does with an endpoint URL.
        virtual = host.endswith(".amazonaws.com") and "." not in self.bucket
        self._host = f"{self.bucket}.{host}" if virtual else host
        self._port = url.port or (443 if self._https else 80)
        netloc = self._host if url.port is None else f"{self._host}:{url.port}"
        self._base = f"{url.scheme}://{netloc}"
        # (an endpoint under a path, a gateway's /s3, keeps it before the bucket or key)
        self._path_prefix = url.path.rstrip("/") + (
            "" if virtual else "/" + urllib.parse.quote(self.bucket))
        self._connector = Connector(self._host, self._port, https=self._https,
                                    connect_timeout=self._connect_timeout)

    @property
    def endpoint(self) -> str:
        return self._base

    def _region_named(self, status: int, headers: dict[str, str], body: bytes) -> str | None:
        """The bucket's region, when S3 refused a request for being signed for (or sent
        to) another: 400 AuthorizationHeaderMalformed or 301 PermanentRedirect."""
        if status not in (301, 400) or (status == 400 and self._code(body)
                                        != "AuthorizationHeaderMalformed"):
            return None
        region = headers.get("x-amz-bucket-region")
        if not region:
            m = _REGION_RE.search(body)
            region = m.group(1).decode(errors="replace") if m else None
        return region or None

    def _move_to(self, region: str) -> None:
        """Sign for ``region`` from now on (and send to its endpoint, when the endpoint was
        made from the region); one log line."""
        with self._moving:
            if region == self.region:
                return
            old, self.region = self.region, region
            if self._endpoint_for is not None:
                self._set_endpoint(self._endpoint_for(region))
                self._generation += 1
        self.close()
        log.warning("s3://%s is in %s, not %s: signing for %s (--shared-cache-region %s says "
                    "so at mount)", self.bucket, region, old, region, region)

    # -- connections ------------------------------------------------------------------
    def _connect(self, *, pooled: bool = True) -> tuple[http.client.HTTPConnection, bool]:
        """A connection, and whether it was kept alive from an earlier request."""
        if pooled:
            try:
                return self._pool.get_nowait(), True
            except queue.Empty:
                pass
        conn = self._connector.new()
        try:
            conn.connect()
        except (OSError, http.client.HTTPException) as exc:
            conn.close()
            via = self._connector.via_proxy
            where = self._base + (f" via proxy {via}" if via else "")
            raise EndpointUnreachable(f"cannot connect to {where}: {exc}") from exc
        assert conn.sock is not None
        conn.sock.settimeout(self._read_timeout)
        conn.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return conn, False

    def _release(self, conn: http.client.HTTPConnection, generation: int) -> None:
        if generation != self._generation:  # (to an endpoint no longer used)
            conn.close()
            return
        try:
            self._pool.put_nowait(conn)
        except queue.Full:
            conn.close()

    def close(self) -> None:
        while True:
            try:
                self._pool.get_nowait().close()
            except queue.Empty:
                return

    # -- signing ----------------------------------------------------------------------
    def _sign(self, method: str, path: str, headers: dict[str, str], body: bytes,
              session: express.SessionCredentials | None) -> dict[str, str]:
        request = AWSRequest(method, self._base + path, headers=headers, data=body)
        request.context["client_config"] = _UnsignedPayload()
        if session is not None:
            creds = Credentials(session.access_key, session.secret_key, session.token)
            S3ExpressAuth(creds, express.SIGNING_NAME, self.region,
                          identity_cache=None).add_auth(request)
        elif self._credentials is not None:
            frozen = self._credentials.get_frozen_credentials()
            S3SigV4Auth(frozen, "s3", self.region).add_auth(request)
        elif not self._anonymous:
            raise CredentialsError(NO_CREDENTIALS)
        return dict(request.headers.items())

    def create_session(self) -> express.SessionCredentials:
        """One CreateSession request (signed with the IAM credentials, service s3express)."""
        if self._credentials is None:
            raise CredentialsError(NO_CREDENTIALS)
        path = (self._path_prefix or "") + "/?session"
        headers = {} if self._session_mode is None else {
            "x-amz-create-session-mode": self._session_mode}
        request = AWSRequest("GET", self._base + path, headers=headers)
        S3SigV4Auth(self._credentials.get_frozen_credentials(), express.SIGNING_NAME,
                    self.region).add_auth(request)
        status, _, body = self._send("session", "GET", path, dict(request.headers.items()), b"")
        if status != 200:
            raise self._error(status, body, None)
        return express.parse_create_session(body)

    # -- requests -----------------------------------------------------------------------
    def _path(self, key: str) -> str:
        return self._path_prefix + "/" + urllib.parse.quote(key, safe="/~")

    def _send(self, op: str, method: str, path: str, headers: dict[str, str],
              body: bytes, timeout: float | None = None) -> tuple[int, dict[str, str], bytes]:
        metrics.SHARED_REQUESTS.labels(op).inc()
        t0 = time.monotonic()
        conn: http.client.HTTPConnection | None = None
        generation = self._generation
        try:
            for fresh in (False, True):
                conn, reused = self._connect(pooled=not fresh)
                assert conn.sock is not None
                conn.sock.settimeout(self._read_timeout if timeout is None else timeout)
                try:
                    conn.request(method, self._connector.target(path), body=body or None,
                                 headers={**headers, **self._connector.request_headers()})
                    resp = conn.getresponse()
                except ConnectionError:  # (RemoteDisconnected too: closed before an answer)
                    if not reused:
                        raise
                    conn.close()  # a kept-alive connection the store dropped: a new one
                    conn = None
                    metrics.SHARED_REQUESTS.labels(op).inc()
                    continue
                break
            data = resp.read()
            status = resp.status
            got = {k.lower(): v for k, v in resp.getheaders()}
            reusable = not resp.will_close
        except StoreError:
            raise
        except TimeoutError as exc:
            if conn is not None:
                conn.close()
            raise RequestTimeout(f"{self._base}: {op}: no answer within "
                                 f"{self._read_timeout if timeout is None else timeout:g}s"
                                 ) from exc
        except (OSError, http.client.HTTPException) as exc:
            if conn is not None:
                conn.close()
            raise TransientStoreError(f"{self._base}: {op} failed: {exc!r}",
                                      reason="connection") from exc
        finally:
            metrics.SHARED_LATENCY.labels(op).observe(time.monotonic() - t0)
        assert conn is not None  # (answered)
        if reusable:
            self._release(conn, generation)
        else:
            conn.close()
        return status, got, data

    def _request(self, op: str, method: str, key: str, headers: dict[str, str],
                 body: bytes = b"", timeout: float | None = None
                 ) -> tuple[int, dict[str, str], bytes]:
        path = self._path(key)
        for attempt in (0, 1):
            session = self.sessions.get() if self.sessions is not None else None
            signed = self._sign(method, path, dict(headers), body, session)
            status, got, data = self._send(op, method, path, signed, body, timeout)
            if (session is not None and attempt == 0 and status in (400, 403)
                    and self._code(data) in _SESSION_ERRORS):
                assert self.sessions is not None
                self.sessions.invalidate(session)
                continue
            region = (self._region_named(status, got, data)
                      if self._follow_region and attempt == 0 else None)
            if region is not None:  # (moved already by a request at the same time: again)
                self._move_to(region)
                path = self._path(key)  # (virtual-hosted or not, as the endpoint is)
                continue
            return status, got, data
        raise AssertionError("unreachable")

    @staticmethod
    def _code(body: bytes) -> str:
        m = _CODE_RE.search(body)
        return m.group(1).decode(errors="replace") if m else ""

    def _error(self, status: int, body: bytes, key: str | None) -> StoreError:
        code = self._code(body)
        if status == 507 or code in ("InsufficientStorage", "QuotaExceeded"):
            return StoreError(f"s3://{self.bucket}: store is full ({code or status})")
        return error_for_response(status, code, self.bucket, key, f"HTTP {status}")

    def get(self, key: str, *, timeout: float | None = None) -> Response | None:
        status, headers, body = self._request("get", "GET", key, {}, timeout=timeout)
        if status == 404 and self._code(body) != "NoSuchBucket":
            return None
        if status != 200:
            raise self._error(status, body, key)
        if "content-length" in headers and int(headers["content-length"]) != len(body):
            raise TransientStoreError(f"s3://{self.bucket}/{key}: short body")
        return Response(body, headers)

    def head(self, key: str, *, timeout: float | None = None) -> dict[str, str] | None:
        status, headers, body = self._request("head", "HEAD", key, {}, timeout=timeout)
        if status == 404:
            return None
        if status != 200:
            raise self._error(status, body, key)
        return headers

    def put(self, key: str, body: bytes, *, metadata: dict[str, str] | None = None,
            if_none_match: bool = False, op: str = "put", timeout: float | None = None) -> bool:
        headers = {f"x-amz-meta-{k}": v for k, v in (metadata or {}).items()}
        headers["Content-Type"] = "application/octet-stream"
        if if_none_match:
            headers["If-None-Match"] = "*"
        status, _, data = self._request(op, "PUT", key, headers, body, timeout=timeout)
        if status in (200, 201, 204):
            return True
        if if_none_match and (status == 412 or (status == 409 and self._code(data) ==
                                                "ConditionalRequestConflict")):
            return False
        raise self._error(status, data, key)

    def delete(self, key: str, *, timeout: float | None = None) -> None:
        status, _, body = self._request("delete", "DELETE", key, {}, timeout=timeout)
        if status not in (200, 204, 404):
            raise self._error(status, body, key)


def open_tier_client(bucket: str, *, endpoint_url: str | None, region: str | None,
                     profile: str | None, anonymous: bool, timeout: float,
                     follow_region: bool = False) -> ObjectClient:
    """The client of a shared tier in ``bucket``, credentials from the AWS profile
    ``profile`` (default chain if None) unless ``anonymous``; ``region`` defaults to the
    profile's (else us-east-1) and ``endpoint_url`` to the region's S3 endpoint, or the
    zonal endpoint of an S3 Express directory bucket. With ``follow_region`` (the tier's
    region was not given) the region S3 names when it refuses a request signed for
    another is taken instead (and its endpoint, unless ``endpoint_url`` was given). Makes
    no request; a missing credential fails each request later. Raises ConfigError for a
    profile that does not exist or an unusable endpoint URL (the flags named, for the
    one-line error)."""
    import boto3
    import botocore.exceptions

    try:
        session = boto3.session.Session(profile_name=profile)
    except botocore.exceptions.ProfileNotFound:
        raise ConfigError(f"--shared-cache-profile: AWS profile {profile!r} not found") from None
    region = region or session.region_name or "us-east-1"

    def endpoint_for(region: str) -> str:
        return (express.zonal_endpoint(bucket, region) if express.is_directory_bucket(bucket)
                else f"https://s3.{region}.amazonaws.com")

    made_from_region = endpoint_url is None
    if endpoint_url is None:
        endpoint_url = endpoint_for(region)
    credentials = None if anonymous else session.get_credentials()
    if credentials is not None:  # (renewed in their file, they are picked up, as the origin's)
        credentials = FileCredentials(session._session, credentials)
    try:
        return ObjectClient(bucket, endpoint_url=endpoint_url, region=region,
                            credentials=credentials, anonymous=anonymous,
                            connect_timeout=timeout, read_timeout=timeout,
                            follow_region=follow_region,
                            endpoint_for=endpoint_for if made_from_region else None)
    except ValueError as exc:
        raise ConfigError(f"--shared-cache-endpoint-url: {exc}") from None
