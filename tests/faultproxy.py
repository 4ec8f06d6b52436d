"""A fault-injecting HTTP proxy for S3 tests (loopback only).

Forwards every request to the upstream S3 server, except where the current
``plan`` says otherwise. A plan maps (method, path, request number) to an
action:

* ``pass``        forward
* ``503``         answer 503 SlowDown (S3's throttling answer)
* ``500``         answer 500 InternalError
* ``reset``       reset the connection (RST) without answering (``down`` is the same)
* ``stall``       answer nothing until the proxy closes (a silent server)
* ``stall_body``  send the answer's status and headers, then nothing
* ``truncate``    send the headers (full Content-Length) and half the body, then close
* ``short``       send half the body with a Content-Length saying so
* ``flip``        forward an object GET's body with 8 bytes flipped (same length)
* ``no412``       answer a conditional PUT the upstream refused (412, an object is there)
                  200, as a store that ignores ``If-None-Match`` does (it is not written)
* ``relist``      answer a listing with its first page, said to be truncated, with the same
                  continuation token every time (a server bug: the listing never ends)

``path_prefix`` ("/s3") serves the upstream under that path, as some gateways do.
``accepted_keys`` (a set of access key ids) refuses requests signed with any other key
as S3 does (403 InvalidAccessKeyId). ``set_down(True)`` takes the endpoint away altogether (the listening socket is
closed, so connections are refused, and open connections are reset);
``set_down(False)`` brings it back on the same port. ``bucket_region`` makes
the proxy answer like S3 does to a request signed for another region than the
bucket's (400 AuthorizationHeaderMalformed naming the region, HeadBucket: a
400 with only the ``x-amz-bucket-region`` header; or 301 PermanentRedirect
with ``redirect=True``), and report that region on HeadBucket. With
``tls=(certfile, keyfile)`` the proxy speaks HTTPS. Counts requests by method
(``counts``) and faults by action (``faults``) so tests can assert what
reached S3.
"""

from __future__ import annotations

import http.client
import http.server
import random
import re
import socket
import ssl
import struct
import threading
from collections import Counter
from collections.abc import Callable

SLOWDOWN = (b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>SlowDown</Code>'
            b"<Message>Please reduce your request rate.</Message></Error>")
INTERNAL = (b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>InternalError</Code>'
            b"<Message>We encountered an internal error. Please try again.</Message></Error>")

UNKNOWN_KEY = (b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>InvalidAccessKeyId</Code>'
               b"<Message>The AWS Access Key Id you provided does not exist in our records."
               b"</Message></Error>")

# A plan maps (method, path, request number) -> an action (see the module docstring).
Plan = Callable[[str, str, int], str]

_KEY = re.compile(r"Credential=([^/]+)/")
_SCOPE = re.compile(r"Credential=[^/]+/\d{8}/([^/]+)/s3/aws4_request")


def wrong_region_answer(region: str, *, head: bool, redirect: bool,
                        bucket: str) -> tuple[int, dict[str, str], bytes]:
    """What S3 answers a request signed for a region other than the bucket's."""
    headers = {"x-amz-bucket-region": region, "Content-Type": "application/xml"}
    if redirect:
        body = (f'<?xml version="1.0" encoding="UTF-8"?><Error><Code>PermanentRedirect</Code>'
                f"<Message>The bucket you are attempting to access must be addressed using the "
                f"specified endpoint.</Message><Endpoint>{bucket}.s3.{region}.amazonaws.com"
                f"</Endpoint><Bucket>{bucket}</Bucket></Error>").encode()
        status = 301
    else:
        body = (f'<?xml version="1.0" encoding="UTF-8"?><Error>'
                f"<Code>AuthorizationHeaderMalformed</Code><Message>The authorization header "
                f"is malformed; the region 'us-east-1' is wrong; expecting '{region}'</Message>"
                f"<Region>{region}</Region></Error>").encode()
        status = 400
    return status, headers, b"" if head else body


class _QuietServer(http.server.ThreadingHTTPServer):
    """Clients hanging up mid-answer (aborted hedges, unmounts) are normal here."""

    request_queue_size = 128  # the default 5 drops connections of busy clients

    def handle_error(self, request: object, client_address: object) -> None:
        import sys

        if not isinstance(sys.exc_info()[1], OSError):
            super().handle_error(request, client_address)  # type: ignore[arg-type]


class FaultProxy:
    def __init__(self, upstream: str, *, tls: tuple[str, str] | None = None) -> None:
        host, port = upstream.removeprefix("http://").split(":")
        self.upstream = (host, int(port))
        self.plan: Plan = lambda method, path, n: "pass"
        self.counts: Counter[str] = Counter()
        self.faults: Counter[str] = Counter()
        self.bucket_region: str | None = None
        self.redirect = False
        # When set, only requests signed with one of these access keys are forwarded; the
        # others get S3's answer to a key it does not know (403 InvalidAccessKeyId).
        self.accepted_keys: set[str] | None = None
        self.path_prefix = ""
        self._tls = tls
        self._n = 0
        self._lock = threading.Lock()
        self._closing = threading.Event()
        self._conns: set[socket.socket] = set()
        self._down = False
        self._rng = random.Random(7)
        self._address = ("127.0.0.1", 0)
        self.server = self._make_server()
        self._address = self.server.server_address[:2]
        self.thread: threading.Thread | None = None

    # -- the server ---------------------------------------------------------------------
    def _make_server(self) -> http.server.ThreadingHTTPServer:
        proxy = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:
                pass

            def setup(self) -> None:
                super().setup()
                with proxy._lock:
                    proxy._conns.add(self.connection)

            def finish(self) -> None:
                with proxy._lock:
                    proxy._conns.discard(self.connection)
                try:
                    super().finish()
                except OSError:
                    pass

            def _answer(self, status: int, headers: dict[str, str], body: bytes) -> None:
                self.send_response(status)
                for k, v in headers.items():
                    self.send_header(k, v)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(body)

            def _reset(self) -> None:
                # SO_LINGER 0 makes close() send RST: a connection reset by peer.
                self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER,
                                           struct.pack("ii", 1, 0))
                self.close_connection = True
                self.connection.close()

            def _handle(self) -> None:
                with proxy._lock:
                    proxy._n += 1
                    n = proxy._n
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else None
                if proxy.path_prefix:  # (served under a path, as some gateways are)
                    if not self.path.startswith(proxy.path_prefix + "/"):
                        self._answer(404, {}, b"not under " + proxy.path_prefix.encode())
                        return
                    self.path = self.path[len(proxy.path_prefix):]
                if proxy.bucket_region and self._wrong_region():
                    return
                if proxy.accepted_keys is not None and self._unknown_key():
                    return
                action = proxy.plan(self.command, self.path, n)
                if action != "pass":
                    proxy.faults[action] += 1
                if action in ("503", "500"):
                    code = int(action)
                    self._answer(code, {"Content-Type": "application/xml"},
                                 SLOWDOWN if code == 503 else INTERNAL)
                    return
                if action in ("reset", "down"):
                    self._reset()
                    return
                if action == "stall":
                    proxy._closing.wait(120)
                    self._reset()
                    return
                proxy.counts[self.command] += 1
                if action == "relist":  # (the first page again, whatever token was sent)
                    self.path = re.sub(r"([&?])continuation-token=[^&]*&?", r"\1",
                                       self.path)
                status, headers, data = self._forward(body)
                if action == "relist" and status == 200:
                    data = re.sub(rb"<IsTruncated>false</IsTruncated>",
                                  b"<IsTruncated>true</IsTruncated><NextContinuationToken>"
                                  b"again</NextContinuationToken>", data)
                if action == "stall_body" and data:
                    self.send_response(status)
                    for k, v in headers:
                        self.send_header(k, v)
                    self.send_header("Content-Length", self._length(data))
                    self.end_headers()
                    self.wfile.flush()
                    proxy._closing.wait(120)
                    self._reset()
                    return
                if action == "truncate" and data:
                    self.send_response(status)
                    for k, v in headers:
                        self.send_header(k, v)
                    self.send_header("Content-Length", self._length(data))
                    self.end_headers()
                    self.wfile.write(data[:len(data) // 2])
                    self.wfile.flush()
                    self.close_connection = True
                    return
                if action == "no412" and self.command == "PUT" and status == 412:
                    status, headers, data = 200, [("ETag", '"0"')], b""
                if action == "short" and data:
                    data = data[:len(data) // 2]
                if (action == "flip" and data and self.command == "GET" and "?" not in self.path
                        and status in (200, 206)):
                    data = proxy.flip(data)
                self.send_response(status)
                for k, v in headers:
                    self.send_header(k, v)
                self.send_header("Content-Length", self._length(data))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)

            def _length(self, data: bytes) -> str:
                """The Content-Length to send: the body's, or for a HEAD (no body) the
                object's, as the upstream said."""
                return self._head_length if self.command == "HEAD" else str(len(data))

            def _forward(self, body: bytes | None) -> tuple[int, list[tuple[str, str]], bytes]:
                conn = http.client.HTTPConnection(*proxy.upstream, timeout=30)
                try:
                    headers = {k: v for k, v in self.headers.items()
                               if k.lower() != "connection"}
                    conn.request(self.command, self.path, body=body, headers=headers)
                    resp = conn.getresponse()
                    data = resp.read()
                    self._head_length = resp.getheader("Content-Length") or "0"
                    out = []
                    for k, v in resp.getheaders():
                        if k.lower() in ("transfer-encoding", "connection", "content-length"):
                            continue
                        if k.lower() == "x-amz-bucket-region" and proxy.bucket_region:
                            v = proxy.bucket_region
                        out.append((k, v))
                    return resp.status, out, data
                finally:
                    conn.close()

            def _unknown_key(self) -> bool:
                """Answer like S3 to an access key it does not know; True if answered."""
                m = _KEY.search(self.headers.get("Authorization") or "")
                if m and m.group(1) in (proxy.accepted_keys or ()):
                    return False
                proxy.faults["unknown_key"] += 1
                self._answer(403, {"Content-Type": "application/xml"}, UNKNOWN_KEY)
                return True

            def _wrong_region(self) -> bool:
                """Answer like S3 to a request signed for another region; True if answered."""
                m = _SCOPE.search(self.headers.get("Authorization") or "")
                if not m or m.group(1) == proxy.bucket_region:
                    return False
                proxy.faults["wrong_region"] += 1
                bucket = self.path.lstrip("/").split("/", 1)[0].split("?", 1)[0]
                status, headers, body = wrong_region_answer(
                    proxy.bucket_region or "", head=self.command == "HEAD",
                    redirect=proxy.redirect, bucket=bucket)
                self._answer(status, headers, body)
                return True

            do_GET = do_HEAD = do_PUT = do_POST = do_DELETE = _handle

        server = _QuietServer(self._address, Handler)
        server.daemon_threads = True
        if self._tls is not None:
            ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
            ctx.load_cert_chain(*self._tls)
            server.socket = ctx.wrap_socket(server.socket, server_side=True)
        return server

    def flip(self, data: bytes) -> bytes:
        """``data`` with 8 bytes at random places inverted."""
        out = bytearray(data)
        for _ in range(8):
            i = self._rng.randrange(len(out))
            out[i] ^= 0xFF
        return bytes(out)

    @property
    def url(self) -> str:
        host, port = self._address
        return f"{'https' if self._tls else 'http'}://{host}:{port}"

    def _start(self) -> None:
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def set_down(self, down: bool) -> None:
        """Take the endpoint away (refused connections, open ones reset) or bring it back."""
        if down == self._down:
            return
        self._down = down
        if down:
            self.server.shutdown()
            self.server.server_close()
            with self._lock:
                conns = list(self._conns)
            for conn in conns:
                try:
                    conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                    conn.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
        else:
            self.server = self._make_server()
            self._start()

    def __enter__(self) -> FaultProxy:
        self._start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._closing.set()
        if not self._down:
            self.server.shutdown()
            self.server.server_close()


class ForwardProxy:
    """A minimal HTTP forward proxy (loopback): absolute-form requests for http:// targets
    and CONNECT tunnels for https:// ones, as corporate proxies serve HTTPS_PROXY/HTTP_PROXY.
    Records each request's method and target (``seen``) and its Proxy-Authorization."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, str]] = []
        self.auth: list[str | None] = []
        proxy = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:
                pass

            def do_CONNECT(self) -> None:
                proxy.seen.append(("CONNECT", self.path))
                proxy.auth.append(self.headers.get("Proxy-Authorization"))
                host, port = self.path.rsplit(":", 1)
                upstream = socket.create_connection((host, int(port)), timeout=30)
                self.send_response(200, "Connection established")
                self.end_headers()
                self.wfile.flush()
                self.close_connection = True
                _pump(self.connection, upstream)

            def _forward(self) -> None:
                proxy.seen.append((self.command, self.path))
                proxy.auth.append(self.headers.get("Proxy-Authorization"))
                url = self.path.removeprefix("http://")
                hostport, _, path = url.partition("/")
                host, _, port = hostport.partition(":")
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else None
                conn = http.client.HTTPConnection(host, int(port or 80), timeout=30)
                try:
                    headers = {k: v for k, v in self.headers.items()
                               if k.lower() not in ("connection", "proxy-authorization")}
                    conn.request(self.command, "/" + path, body=body, headers=headers)
                    resp = conn.getresponse()
                    data = resp.read()
                    self.send_response(resp.status)
                    for k, v in resp.getheaders():
                        if k.lower() not in ("transfer-encoding", "connection", "content-length"):
                            self.send_header(k, v)
                    # (a HEAD has no body: its length is the object's, as the upstream said)
                    self.send_header("Content-Length", resp.getheader("Content-Length") or "0"
                                     if self.command == "HEAD" else str(len(data)))
                    self.end_headers()
                    if self.command != "HEAD":
                        self.wfile.write(data)
                finally:
                    conn.close()

            do_GET = do_HEAD = do_PUT = do_POST = do_DELETE = _forward

        self.server = _QuietServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        host, port = self.server.server_address[:2]
        return f"http://{host}:{port}"

    def __enter__(self) -> ForwardProxy:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()


def _pump(a: socket.socket, b: socket.socket) -> None:
    """Copy bytes both ways until either side closes."""
    import selectors

    sel = selectors.DefaultSelector()
    sel.register(a, selectors.EVENT_READ, b)
    sel.register(b, selectors.EVENT_READ, a)
    try:
        while True:
            for key, _ in sel.select(timeout=60):
                src: socket.socket = key.fileobj  # type: ignore[assignment]
                data = src.recv(65536)
                if not data:
                    return
                key.data.sendall(data)
    except OSError:
        return
    finally:
        sel.close()
        b.close()


def self_signed_cert(directory: str) -> tuple[str, str]:
    """A certificate for 127.0.0.1 and localhost and its key (PEM files in ``directory``)."""
    import datetime
    import ipaddress
    import os

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "cachefs test S3")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(days=1))
            .not_valid_after(now + datetime.timedelta(days=2))
            .add_extension(x509.SubjectAlternativeName(
                [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                critical=False)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(key, hashes.SHA256()))
    cert_path = os.path.join(directory, "cert.pem")
    key_path = os.path.join(directory, "key.pem")
    with open(cert_path, "wb") as f:
        f.write(cert.public_bytes(serialization.Encoding.PEM))
    with open(key_path, "wb") as f:
        f.write(key.private_bytes(serialization.Encoding.PEM,
                                  serialization.PrivateFormat.TraditionalOpenSSL,
                                  serialization.NoEncryption()))
    return cert_path, key_path
