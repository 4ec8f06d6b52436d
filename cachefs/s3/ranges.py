"""The S3 data plane: signed GETs and HEADs on plain kept-alive connections.

Why not boto3 for GETs: measured on this project's machines, a boto3
``get_object`` of a 110 KB object costs 1.5-4.5 ms of CPU (request model,
event hooks, response parsing) against ~0.55 ms for the same request signed
with botocore's SigV4 signer and sent on a kept-alive ``http.client``
connection (urllib3's pool: ~0.6-0.75 ms; awscrt's S3 client: ~1.0 ms). Less
again now: requests are signed by :mod:`cachefs.s3.sigv4` (botocore's
signature at a fifth of its CPU) and sent and read by :mod:`cachefs.s3.http1`
(``http.client`` only connects: TLS, proxy tunnels). For datasets of small
files the daemon's CPU per file is the limit on 2 cores, so GETs take the
lean path, and so do listings (:meth:`RangeClient.list_page`,
parsed by :mod:`cachefs.s3.listxml`); HEAD and the mount probe stay on boto3
(:mod:`cachefs.s3.boto`). ``benchmarks/getcpu.py`` measures it.

One call is one attempt: retries, deadlines and hedging belong to
:mod:`cachefs.s3.origin`. Each request reports its progress to an
:class:`~cachefs.s3.store.Exchange` (every recv() that returns bytes, at least
every :data:`cachefs.s3.http1.SLICE` seconds while a body arrives), so a
stalled answer can be told from a slow one, and the exchange can abort it
from another thread (the socket is shut down, which wakes a waiting recv()).
The exchange's idle timeout is the longest silence between bytes
(:func:`cachefs.s3.http1.set_idle_timeout`), never a bound on a whole (large,
progressing) body.

Thread-safety: a :class:`RangeClient` is shared by worker threads; each
request takes an idle connection from a LIFO pool (or opens one) and returns
it only after a complete, successful response. A kept-alive connection the
server has closed meanwhile fails before any byte of the answer: the request
is sent once more on a new connection at once (not counted as a failure).
Credentials are read per request (``get_frozen_credentials``) so refreshed
instance-role credentials are picked up.
"""

from __future__ import annotations

import http.client
import re
import socket
import threading
import time
import urllib.parse
import weakref
from collections import deque
from typing import Any

from cachefs import metrics
from cachefs.errors import (
    CredentialsError,
    EndpointUnreachable,
    ObjectChanged,
    StoreError,
    TransientStoreError,
)
from cachefs.s3 import http1
from cachefs.s3.connections import Connector
from cachefs.s3.errors import NO_CREDENTIALS, error_for_response
from cachefs.s3.integrity import Checksum, digest, etag_is_md5, stated_checksum
from cachefs.s3.listxml import parse_list_page
from cachefs.s3.sigv4 import SigV4Signer
from cachefs.s3.store import Body, Exchange, ListPage

_CODE_RE = re.compile(rb"<Code>([^<]+)</Code>")
# Metric children bound once (a labels() lookup costs ~2 us per request).
_REQUESTS = {op: metrics.S3_REQUESTS.labels(op) for op in ("get", "list", "head")}
_LATENCY = {op: metrics.S3_LATENCY.labels(op) for op in ("get", "list", "head")}
_REGION_RE = re.compile(rb"<Region>([^<]+)</Region>")


class _Answer:
    __slots__ = ("body", "headers", "md5", "status")

    def __init__(self, status: int, headers: dict[str, str], body: bytes,
                 md5: bytes | None = None) -> None:
        self.status = status
        self.headers = headers
        self.body = body
        self.md5 = md5  # the body's MD5, when computed on the way (http1.exchange_plain)


#: The answer headers cachefs reads (prefixes of lower-cased names).
#: The answer headers a GET keeps (prefixes of lower-case names): Content-Range states a
#: 206's object size (_stated_size).
_WANTED = ("etag", "x-amz-checksum", "x-amz-server-side-encryption", "x-amz-bucket-region",
           "content-range")


_CONTENT_RANGE_RE = re.compile(r"bytes\s+\d+-\d+/(\d+)\s*$")


def _stated_size(answer: _Answer, etag: str) -> int | None:
    """The object's whole size as a GET answer states it: the total of a 206's
    Content-Range; the body of a 200 only when the body proves to be the whole object (it
    matches the full-object checksum S3 states, or the ETag when that is an MD5; a body
    cut short on the way, Content-Length too, proves nothing); None otherwise."""
    if answer.status == 206:
        m = _CONTENT_RANGE_RE.match(answer.headers.get("content-range", ""))
        return int(m.group(1)) if m else None
    stated = stated_checksum(answer.headers)
    if stated is not None:
        kind, expected = stated.kind, stated.digest
    elif etag_is_md5(etag, answer.headers):
        kind, expected = "etag_md5", bytes.fromhex(etag)
    else:
        return None
    return len(answer.body) if digest(kind, answer.body) == expected else None


def _reason(exc: BaseException) -> str:
    if isinstance(exc, TimeoutError):
        return "timeout"
    if isinstance(exc, http.client.IncompleteRead):
        return "short_body"
    return "connection"


def _dropped(conn: http.client.HTTPConnection) -> bool:
    """Whether an idle kept-alive connection can no longer be sent on: closed, or
    readable while no answer is due (the server closed it, or sent something
    unasked). One poll of the socket, without waiting."""
    sock = conn.sock
    return sock is None or http1.dropped(sock)


class RangeClient:
    """Signed GETs and HEADs of one bucket."""

    def __init__(self, bucket: str, *, endpoint_url: str, region: str, credentials: Any,
                 anonymous: bool, max_connections: int, connect_timeout: float,
                 read_timeout: float, ca_bundle: str | None = None) -> None:
        self.bucket = bucket
        url = urllib.parse.urlsplit(endpoint_url)
        https = url.scheme == "https"
        host = url.hostname or ""
        # AWS endpoints: virtual-hosted style (path style is deprecated there);
        # other S3-compatible servers: path style, as boto3 does with an endpoint URL.
        virtual = host.endswith(".amazonaws.com") and "." not in bucket
        self._host = f"{bucket}.{host}" if virtual else host
        port = url.port or (443 if https else 80)
        netloc = self._host if url.port is None else f"{self._host}:{url.port}"
        self._base = f"{url.scheme}://{netloc}"
        # The Host header as the signer computes it (no default port).
        self._host_header = self._host if url.port in (None, 443 if https else 80) else netloc
        # (an endpoint under a path, a gateway's /s3, keeps it before the bucket or key)
        self._path_prefix = url.path.rstrip("/") + (
            "" if virtual else "/" + urllib.parse.quote(bucket))
        self.region = region
        self._signer = SigV4Signer(self._host_header, region)
        self._credentials = credentials
        self._anonymous = anonymous
        self.read_timeout = read_timeout
        self.connector = Connector(self._host, port, https=https, connect_timeout=connect_timeout,
                                   ca_bundle=ca_bundle)
        # Idle kept-alive connections, the last given back taken first, at most
        # max_connections (the bound is checked under _pool_lock; deque's pop is atomic).
        self._pool: deque[http.client.HTTPConnection] = deque()
        self._pool_max = max_connections
        self._pool_lock = threading.Lock()
        # The idle timeout each open socket is set up for (http1.set_idle_timeout).
        self._idle: weakref.WeakKeyDictionary[socket.socket, float] = \
            weakref.WeakKeyDictionary()

    # -- connections ------------------------------------------------------------
    def _connection(self, *, fresh: bool = False,
                    polled: bool = False) -> tuple[http.client.HTTPConnection, bool]:
        """An idle pooled connection (reused=True) or a new connected one (always new
        with ``fresh``). Pooled connections the server has closed meanwhile (its idle
        timeout: readable, at end of file) are dropped here rather than sent on --
        unless ``polled``: then the caller's exchange polls it (http1.exchange_plain's
        ``pooled``) and drops it."""
        while not fresh:
            try:
                conn = self._pool.pop()
            except IndexError:
                break
            if conn.sock is None or (not polled and _dropped(conn)):
                conn.close()
                continue
            return conn, True
        conn = self.connector.new()
        try:
            conn.connect()
        except (OSError, http.client.HTTPException) as exc:
            conn.close()
            where = self._base + (f" via proxy {self.connector.via_proxy}"
                                  if self.connector.via_proxy else "")
            raise EndpointUnreachable(f"cannot connect to {where}: {exc}") from exc
        assert conn.sock is not None
        conn.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return conn, False

    def prewarm(self, n: int) -> int:
        """Open ``n`` connections at once (one thread each) and pool them, so that the
        first requests of a cold start do not each pay a connection's round trips (TCP,
        and TLS on S3 itself: two or three across regions). Blocking; failures are
        ignored (the requests that follow report what is wrong). Returns how many
        connections were pooled."""
        opened: list[http.client.HTTPConnection] = []

        def one() -> None:
            try:
                opened.append(self._connection(fresh=True)[0])
            except StoreError:
                pass

        threads = [threading.Thread(target=one, name="cachefs-connect", daemon=True)
                   for _ in range(max(0, min(n, self._pool_max)))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for conn in opened:
            self._release(conn)
        return len(opened)

    def _release(self, conn: http.client.HTTPConnection) -> None:
        with self._pool_lock:
            if len(self._pool) < self._pool_max:
                self._pool.append(conn)
                return
        conn.close()

    # -- requests -----------------------------------------------------------------
    def _signed(self, method: str, path: str, extra: dict[str, str]) -> dict[str, str]:
        if self._credentials is None:
            if not self._anonymous:
                raise CredentialsError(NO_CREDENTIALS)
            headers = dict(extra)
            headers["Host"] = self._host_header
        else:
            # Read per request: refreshed (instance-role) credentials are picked up.
            frozen = self._credentials.get_frozen_credentials()
            headers = self._signer.sign(method, path, extra, frozen)
        proxy = self.connector.request_headers()
        if proxy:
            headers.update(proxy)
        return headers

    def _exchange(self, op: str, method: str, path: str, extra: dict[str, str],
                  exchange: Exchange, where: str, *, expect: int = 0,
                  md5: bool = False) -> _Answer:
        """Send one request and read the whole answer. Raises TransientStoreError for
        connection trouble (after one immediate resend when a kept-alive connection
        turns out to be closed) and CredentialsError; never an OSError.

        ``expect`` (a GET's length, > 0): on a plain socket the exchange is made by
        :func:`cachefs.s3.http1.exchange_plain` (one C call where built), computing the
        body's MD5 on the way with ``md5``; TLS sockets keep the Python path."""
        headers = self._signed(method, path, extra)
        target = self.connector.target(path)
        plain = bool(expect) and not self.connector.https  # (https: TLS sockets)
        request: bytes | None = None
        exchanged: tuple[int, dict[str, str], bytes, bool, bytes | None] | None = None
        fresh = False
        for resend in (False, True):
            (_REQUESTS.get(op) or metrics.S3_REQUESTS.labels(op)).inc()
            t0 = time.monotonic()
            conn: http.client.HTTPConnection | None = None
            reused = False
            try:
                while True:
                    conn, reused = self._connection(fresh=fresh, polled=plain)
                    sock = conn.sock
                    exchange.attach(sock)
                    assert sock is not None
                    idle = exchange.idle_timeout
                    if self._idle.get(sock) != idle:  # (set once per connection and timeout)
                        http1.set_idle_timeout(sock, idle)
                        self._idle[sock] = idle
                    exchange.sending()
                    if not plain:
                        break
                    if request is None:
                        request = http1.request(method, target, headers)
                    exchanged = http1.exchange_plain(sock, request, expect, exchange, idle,
                                                     _WANTED, md5, pooled=reused)
                    if exchanged is not None:
                        break
                    conn.close()  # a pooled connection the server closed: not sent on
                    conn = None
                if plain:
                    assert exchanged is not None
                    status, got, body, will_close, digest = exchanged
                    answer = _Answer(status, got, body, digest)
                else:
                    http1.send(sock, method, target, headers)
                    status, got, body, will_close = http1.read_answer(
                        http1.SocketReader(sock, exchange, idle), method, _WANTED)
                    answer = _Answer(status, got, body)
                reusable = not will_close
            except StoreError as exc:
                if conn is not None:
                    conn.close()
                metrics.S3_ERRORS.labels(op, type(exc).__name__).inc()
                raise
            except (OSError, http.client.HTTPException) as exc:
                assert conn is not None
                conn.close()
                if exchange.aborted:
                    raise TransientStoreError(f"{where}: request abandoned",
                                              reason="stopping") from exc
                if reused and not resend and exchange.first_byte_at is None:
                    # A kept-alive connection the server had closed: once more, on a new
                    # one (the next pooled one may have been closed as well).
                    fresh = True
                    continue
                metrics.S3_ERRORS.labels(op, "TransientStoreError").inc()
                raise TransientStoreError(f"{where}: connection problem: {exc!r}",
                                          reason=_reason(exc)) from exc
            finally:
                exchange.detach()
                (_LATENCY.get(op) or metrics.S3_LATENCY.labels(op)).observe(
                    time.monotonic() - t0)
            if reusable:
                self._release(conn)
            else:
                conn.close()
            return answer
        raise AssertionError("unreachable")

    def _object_path(self, key: str) -> str:
        return self._path_prefix + "/" + urllib.parse.quote(key, safe="/~")

    def _error(self, op: str, answer: _Answer, key: str | None) -> StoreError:
        m = _CODE_RE.search(answer.body)
        code = m.group(1).decode(errors="replace") if m else ""
        err = error_for_response(answer.status, code, self.bucket, key, f"HTTP {answer.status}")
        metrics.S3_ERRORS.labels(op, type(err).__name__).inc()
        if isinstance(err, TransientStoreError) and err.throttled:
            metrics.S3_THROTTLES.labels(op).inc()
        return err

    def _check_version(self, op: str, answer: _Answer, key: str, etag: str) -> None:
        got = answer.headers.get("etag", "").strip('"')
        if etag and got and got != etag:
            # Some S3-compatible servers ignore If-Match: the ETag is checked here too.
            metrics.S3_ERRORS.labels(op, "ObjectChanged").inc()
            raise ObjectChanged(f"s3://{self.bucket}/{key} changed (ETag {got}, expected {etag})")

    def get(self, key: str, etag: str, start: int, end: int, *, whole: bool = False,
            exchange: Exchange | None = None, md5: bool = False) -> Body:
        """Bytes [start, end) of version ``etag`` of ``key`` (see ObjectStore.get)."""
        where = f"s3://{self.bucket}/{key}"
        # No ETag (a manifest row without one): no version to pin, so no If-Match at all;
        # "*" is answered 412 by S3-compatible servers.
        extra = {"If-Match": f'"{etag}"'} if etag else {}
        if whole:
            extra["x-amz-checksum-mode"] = "ENABLED"
        else:
            extra["Range"] = f"bytes={start}-{end - 1}"
        answer = self._exchange("get", "GET", self._object_path(key), extra,
                                exchange or Exchange(self.read_timeout), where,
                                expect=end - start, md5=md5 and whole)
        if answer.status == 416 and not whole:  # (the range starts past the object's end)
            self._check_version("get", answer, key, etag)
            metrics.S3_ERRORS.labels("get", "ObjectChanged").inc()
            raise ObjectChanged(f"{where} is {start} bytes or fewer, not at least {end} as the "
                                "mount shows (its listing or manifest is out of date)")
        if answer.status not in (200, 206):
            raise self._error("get", answer, key)
        self._check_version("get", answer, key, etag)
        body = answer.body
        if answer.status == 200 and not whole and (start > 0 or len(body) > end - start):
            body = body[start:end]  # a server that ignored Range sent the whole object
        if len(body) != end - start:
            size = _stated_size(answer, etag)
            if size is not None and (size < end or (whole and size != end)):
                # A complete answer about an object of another size than the version read
                # (a manifest's wrong size, or one without an ETag to tell versions apart):
                # that version does not exist, and asking again will not make it.
                metrics.S3_ERRORS.labels("get", "ObjectChanged").inc()
                shown = f"{end}" if whole else f"at least {end}"
                raise ObjectChanged(f"{where} is {size} bytes, not {shown} as the mount shows "
                                    "(its listing or manifest is out of date)")
            metrics.S3_ERRORS.labels("get", "ShortRead").inc()
            raise TransientStoreError(f"{where}: got {len(body)} bytes for range "
                                      f"{start}-{end - 1}", reason="short_body")
        metrics.S3_BYTES.inc(len(body))
        if not whole:
            return Body(body)
        return Body(body, stated_checksum(answer.headers),
                    etag_is_md5(etag, answer.headers) and answer.status == 200, answer.md5)

    def get_range(self, key: str, etag: str, start: int, end: int) -> bytes:
        """Bytes [start, end) of version ``etag`` of ``key``. Raises cachefs errors only."""
        return self.get(key, etag, start, end).data

    def list_page(self, prefix: str, token: str | None, *, delimiter: str = "/",
                  max_keys: int = 1000, start_after: str | None = None,
                  exchange: Exchange | None = None) -> ListPage:
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
        answer = self._exchange("list", "GET", path, {}, exchange or Exchange(self.read_timeout),
                                f"s3://{self.bucket}/{prefix}")
        if answer.status != 200:
            raise self._error("list", answer, None)
        try:
            page = parse_list_page(answer.body)
        except StoreError as exc:
            # A 200 whose XML does not parse was cut or garbled on the way (a server that
            # always answers garbage fails at the retry deadline instead).
            metrics.S3_ERRORS.labels("list", "TransientStoreError").inc()
            raise TransientStoreError(f"s3://{self.bucket}/{prefix}: {exc}",
                                      reason="short_body") from exc
        if token and page.next_token == token:
            # A server bug (botocore's paginators refuse it too): the listing would never
            # end, the same page listed again and again. Not tried again: it would repeat.
            metrics.S3_ERRORS.labels("list", "RepeatedToken").inc()
            raise StoreError(f"s3://{self.bucket}/{prefix}: S3 answered a listing's page "
                             "with the continuation token it was asked for (the listing "
                             "would never end)")
        return page

    def full_checksum(self, key: str, etag: str,
                      exchange: Exchange | None = None) -> Checksum | None:
        """HEAD with checksum mode: the object's full-object checksum, or None."""
        extra = {"x-amz-checksum-mode": "ENABLED"}
        if etag:
            extra["If-Match"] = f'"{etag}"'  # (none without an ETag, as in get())
        answer = self._exchange("head", "HEAD", self._object_path(key), extra,
                                exchange or Exchange(self.read_timeout),
                                f"s3://{self.bucket}/{key}")
        if answer.status != 200:
            raise self._error("head", answer, key)
        self._check_version("head", answer, key, etag)
        return stated_checksum(answer.headers)

    def bucket_region(self) -> str | None:
        """The bucket's region as S3 states it, or None (S3-compatible servers often do
        not say). HeadBucket answers carry ``x-amz-bucket-region`` whatever their status
        (200, 301 PermanentRedirect, 400 for a request signed for another region, 403);
        when it is missing, a one-key listing's error answer may name the region
        (``<Region>`` of AuthorizationHeaderMalformed, or the same header on a 301)."""
        where = f"s3://{self.bucket}"
        bucket_root = self._path_prefix or "/"
        answer = self._exchange("head", "HEAD", bucket_root, {}, Exchange(self.read_timeout),
                                where)
        region = answer.headers.get("x-amz-bucket-region")
        if region or answer.status not in (301, 307, 400):
            return region or None
        answer = self._exchange("list", "GET", bucket_root + "?list-type=2&max-keys=1", {},
                                Exchange(self.read_timeout), where)
        region = answer.headers.get("x-amz-bucket-region")
        if not region:
            m = _REGION_RE.search(answer.body)
            region = m.group(1).decode(errors="replace") if m else None
        return region or None
