"""An S3 Express One Zone stand-in on loopback: CreateSession and session-signed objects.

What it checks is what the zonal endpoint checks: ``GET /BUCKET?session`` must be
SigV4-signed for service ``s3express`` with the IAM key; every object request
must be SigV4-signed for ``s3express`` with the *session's* key and carry the
session token in ``x-amz-s3session-token`` (and no ``X-Amz-Security-Token``).
Signatures are verified here from the SigV4 specification (canonical request,
string to sign, HMAC chain), independently of botocore. Objects live in a dict
(GET, HEAD, PUT with ``If-None-Match: *`` and ``x-amz-meta-*``, DELETE).

``revoke()`` makes the current token answer 400 ExpiredToken, as an expired
session does; ``session_seconds`` sets the lifetime of new sessions.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import hmac
import http.server
import threading
import urllib.parse
import uuid
from collections import Counter
from typing import Any

REGION = "us-west-2"


def _sign_key(secret: str, date: str, region: str, service: str) -> bytes:
    key = ("AWS4" + secret).encode()
    for part in (date, region, service, "aws4_request"):
        key = hmac.new(key, part.encode(), hashlib.sha256).digest()
    return key


def verify_sigv4(method: str, raw_path: str, headers: dict[str, str], secrets: dict[str, str]
                 ) -> tuple[str, str] | str:
    """(access key, service) of a correctly signed request, else the reason it is not."""
    auth = headers.get("authorization", "")
    if not auth.startswith("AWS4-HMAC-SHA256 "):
        return "no SigV4 Authorization header"
    fields = dict(part.strip().split("=", 1) for part in auth[len("AWS4-HMAC-SHA256 "):].split(","))
    access_key, date, region, service, _ = fields["Credential"].split("/")
    if access_key not in secrets:
        return f"unknown access key {access_key}"
    signed = fields["SignedHeaders"].split(";")
    path, _, query = raw_path.partition("?")
    params = sorted(urllib.parse.parse_qsl(query, keep_blank_values=True))
    canonical_query = "&".join(f"{urllib.parse.quote(k, safe='-_.~')}="
                               f"{urllib.parse.quote(v, safe='-_.~')}" for k, v in params)
    canonical_headers = "".join(f"{h}:{' '.join(headers.get(h, '').split())}\n" for h in signed)
    canonical = "\n".join([method, path, canonical_query, canonical_headers, ";".join(signed),
                           headers.get("x-amz-content-sha256", "")])
    amz_date = headers.get("x-amz-date", "")
    scope = f"{date}/{region}/{service}/aws4_request"
    to_sign = "\n".join(["AWS4-HMAC-SHA256", amz_date, scope,
                         hashlib.sha256(canonical.encode()).hexdigest()])
    want = hmac.new(_sign_key(secrets[access_key], date, region, service), to_sign.encode(),
                    hashlib.sha256).hexdigest()
    if not hmac.compare_digest(want, fields["Signature"]):
        return "signature does not match"
    if region != REGION:
        return f"signed for region {region}"
    return access_key, service


class ExpressStub:
    """A directory-bucket endpoint for one IAM identity (``access_key``/``secret_key``)."""

    def __init__(self, access_key: str, secret_key: str, *, session_seconds: float = 300) -> None:
        self.iam = (access_key, secret_key)
        self.session_seconds = session_seconds
        self.sessions: dict[str, tuple[str, str, bool]] = {}  # session key -> (secret, token, ok)
        self.objects: dict[tuple[str, str], tuple[bytes, dict[str, str]]] = {}
        self.counts: Counter[str] = Counter()
        self.rejected: list[str] = []
        self.deny_sessions = False
        self._lock = threading.Lock()
        stub = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:
                pass

            def _reply(self, status: int, body: bytes = b"",
                       headers: dict[str, str] | None = None) -> None:
                self.send_response(status)
                for k, v in (headers or {}).items():
                    self.send_header(k, v)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(body)

            def _error(self, status: int, code: str) -> None:
                self._reply(status, f"<Error><Code>{code}</Code></Error>".encode(),
                            {"Content-Type": "application/xml"})

            def _handle(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else b""
                headers = {k.lower(): v for k, v in self.headers.items()}
                with stub._lock:
                    stub._serve(self, headers, body)

            do_GET = do_HEAD = do_PUT = do_DELETE = _handle

        class Server(http.server.ThreadingHTTPServer):
            request_queue_size = 128

        self.server = Server(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        host, port = self.server.server_address[:2]
        return f"http://{host}:{port}"

    def __enter__(self) -> ExpressStub:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()

    def revoke(self) -> None:
        """Every session issued so far now answers 400 ExpiredToken."""
        with self._lock:
            for key, (secret, token, _) in list(self.sessions.items()):
                self.sessions[key] = (secret, token, False)

    def _reject(self, h: Any, status: int, code: str, why: str) -> None:
        self.rejected.append(f"{h.command} {h.path}: {why}")
        h._error(status, code)

    def _serve(self, h: Any, headers: dict[str, str], body: bytes) -> None:
        path, _, query = h.path.partition("?")
        parts = path.lstrip("/").split("/", 1)
        bucket = urllib.parse.unquote(parts[0])
        key = urllib.parse.unquote(parts[1]) if len(parts) > 1 else ""
        if h.command == "GET" and query == "session" and not key:
            self.counts["CreateSession"] += 1
            who = verify_sigv4("GET", h.path, headers, {self.iam[0]: self.iam[1]})
            if isinstance(who, str) or who[1] != "s3express":
                return self._reject(h, 403, "SignatureDoesNotMatch", str(who))
            if "x-amz-s3session-token" in headers:
                return self._reject(h, 400, "InvalidRequest", "session token on CreateSession")
            if self.deny_sessions:
                return self._reject(h, 403, "AccessDenied", "CreateSession denied")
            mode = headers.get("x-amz-create-session-mode", "ReadWrite")
            ak, sk, token = (f"ASIA{uuid.uuid4().hex[:16].upper()}", uuid.uuid4().hex,
                             f"{mode}-{uuid.uuid4().hex}")
            self.sessions[ak] = (sk, token, True)
            expires = dt.datetime.now(dt.UTC) + dt.timedelta(seconds=self.session_seconds)
            xml = ("<?xml version=\"1.0\" encoding=\"UTF-8\"?><CreateSessionResult "
                   "xmlns=\"http://s3.amazonaws.com/doc/2006-03-01/\"><Credentials>"
                   f"<SessionToken>{token}</SessionToken><SecretAccessKey>{sk}</SecretAccessKey>"
                   f"<AccessKeyId>{ak}</AccessKeyId><Expiration>"
                   f"{expires.strftime('%Y-%m-%dT%H:%M:%SZ')}</Expiration></Credentials>"
                   "</CreateSessionResult>").encode()
            return h._reply(200, xml, {"Content-Type": "application/xml"})
        self.counts[h.command] += 1
        if "x-amz-security-token" in headers:
            return self._reject(h, 400, "InvalidRequest", "X-Amz-Security-Token on a zonal call")
        secrets = {ak: sk for ak, (sk, _, _) in self.sessions.items()}
        who = verify_sigv4(h.command, h.path, headers, secrets)
        if isinstance(who, str):
            return self._reject(h, 403, "SignatureDoesNotMatch", who)
        access_key, service = who
        _secret, token, valid = self.sessions[access_key]
        if service != "s3express" or headers.get("x-amz-s3session-token") != token:
            return self._reject(h, 403, "AccessDenied", "session token missing or not the key's")
        if not valid:
            return self._reject(h, 400, "ExpiredToken", "session expired")
        if h.command == "PUT":
            if token.startswith("ReadOnly"):
                return self._reject(h, 403, "AccessDenied", "read-only session")
            if headers.get("if-none-match") == "*" and (bucket, key) in self.objects:
                return h._error(412, "PreconditionFailed")
            meta = {k: v for k, v in headers.items() if k.startswith("x-amz-meta-")}
            self.objects[(bucket, key)] = (body, meta)
            return h._reply(200, b"", {"ETag": '"' + hashlib.md5(body).hexdigest() + '"'})
        if h.command == "DELETE":
            self.objects.pop((bucket, key), None)
            return h._reply(204)
        if (bucket, key) not in self.objects:
            return h._error(404, "NoSuchKey")
        data, meta = self.objects[(bucket, key)]
        extra = {"Content-Type": "application/octet-stream", **meta}
        if h.command == "HEAD":
            h.send_response(200)
            for k, v in extra.items():
                h.send_header(k, v)
            h.send_header("Content-Length", str(len(data)))
            h.end_headers()
            return None
        return h._reply(200, data, extra)
