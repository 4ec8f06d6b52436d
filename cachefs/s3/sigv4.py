"""AWS Signature Version 4 for the lean S3 requests (GETs, HEADs, listings).

The same signature botocore's ``S3SigV4Auth`` computes for these requests
(``tests/test_sigv4.py`` checks it header for header against botocore), at a
fraction of its CPU: botocore builds an ``AWSRequest``, walks its headers
through several helper objects and derives the signing key with four HMACs
for every request (~65 us per GET on this project's machines, ~15% of a small
GET's client CPU). Here the canonical request is built from plain strings and
the signing key, which depends only on the secret key, the date, the region
and the service, is derived once per day (or per credential rotation).

What is signed, as botocore does for S3:

* the path as sent (already percent-encoded once; S3 paths are not
  normalised), and the query string split on ``&``/``=``, sorted, as sent
  (callers encode it strictly, RFC 3986);
* every header given, names lower-cased and sorted, values trimmed with inner
  runs of spaces collapsed, plus ``host``, ``x-amz-date``,
  ``x-amz-content-sha256`` and, with temporary credentials,
  ``x-amz-security-token``;
* the payload hash of an empty body: every request here is a GET or HEAD
  without a body, so it is a constant and costs nothing (the saving
  ``UNSIGNED-PAYLOAD`` would bring to a request with a body).

Headers added after signing (a plain-http proxy's ``Proxy-Authorization``)
are not signed, as with botocore.

Thread-safety: a :class:`SigV4Signer` is shared by the S3 worker threads. Its
one cached signing key is replaced as a whole tuple (an atomic attribute store
under the GIL), so a thread reads either the old or the new one, each
consistent; two threads deriving the same key at once both get the right key.
"""

from __future__ import annotations

import hashlib
import hmac
import time
from collections.abc import Mapping
from typing import Any

EMPTY_SHA256 = hashlib.sha256(b"").hexdigest()
ALGORITHM = "AWS4-HMAC-SHA256"
#: Headers never signed (botocore's list: hop-by-hop and tracing headers).
UNSIGNED_HEADERS = frozenset((
    "baggage", "connection", "expect", "keep-alive", "proxy-authenticate",
    "proxy-authorization", "te", "traceparent", "tracestate", "trailer",
    "transfer-encoding", "upgrade", "user-agent", "x-amzn-trace-id"))


def _hmac(key: bytes, msg: str) -> bytes:
    return hmac.new(key, msg.encode(), hashlib.sha256).digest()


def _canonical_query(query: str) -> str:
    """The query as SigV4 signs it: pairs sorted (by name, then value), as sent."""
    if not query:
        return ""
    pairs = sorted(pair.partition("=")[::2] for pair in query.split("&"))
    return "&".join(f"{k}={v}" for k, v in pairs)


class SigV4Signer:
    """Signs requests to one host for one region and service."""

    def __init__(self, host: str, region: str, service: str = "s3") -> None:
        self.host = host  # the Host header as sent (no default port)
        self.region = region
        self.service = service
        self._scope_tail = f"{region}/{service}/aws4_request"
        # (secret key, date) -> signing key, the one in use now (see the module doc).
        self._key: tuple[str, str, bytes] = ("", "", b"")

    def signing_key(self, secret_key: str, date: str) -> bytes:
        """The key for ``date`` (YYYYMMDD): HMAC chain over date, region, service."""
        cached = self._key
        if cached[0] == secret_key and cached[1] == date and cached[2]:
            return cached[2]
        key = _hmac(_hmac(_hmac(_hmac(f"AWS4{secret_key}".encode(), date), self.region),
                          self.service), "aws4_request")
        self._key = (secret_key, date, key)
        return key

    def sign(self, method: str, target: str, headers: Mapping[str, str], credentials: Any,
             now: float | None = None) -> dict[str, str]:
        """The headers to send with ``method target`` (path, optionally ``?query``):
        ``headers``, ``Host``, the ``X-Amz-*`` headers and ``Authorization``.
        ``credentials`` has ``access_key``, ``secret_key`` and ``token`` (botocore's
        frozen credentials); ``now`` (seconds since the epoch) is for tests."""
        stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(time.time() if now is None else now))
        out = dict(headers)
        out["X-Amz-Date"] = stamp
        out["X-Amz-Content-SHA256"] = EMPTY_SHA256
        token = credentials.token
        if token:
            out["X-Amz-Security-Token"] = token
        signed = {low: " ".join(value.split()) for name, value in out.items()
                  if (low := name.lower()) not in UNSIGNED_HEADERS}
        signed["host"] = self.host
        names = sorted(signed)
        signed_names = ";".join(names)
        path, _, query = target.partition("?")
        canonical = "\n".join((
            method, path, _canonical_query(query),
            "".join(f"{n}:{signed[n]}\n" for n in names), signed_names, EMPTY_SHA256))
        date = stamp[:8]
        scope = f"{date}/{self._scope_tail}"
        to_sign = "\n".join((ALGORITHM, stamp, scope,
                             hashlib.sha256(canonical.encode()).hexdigest()))
        signature = hmac.new(self.signing_key(credentials.secret_key, date), to_sign.encode(),
                             hashlib.sha256).hexdigest()
        out["Host"] = self.host
        out["Authorization"] = (f"{ALGORITHM} Credential={credentials.access_key}/{scope}, "
                                f"SignedHeaders={signed_names}, Signature={signature}")
        return out


__all__ = ["EMPTY_SHA256", "SigV4Signer"]
