"""A synthetic S3 endpoint: buckets of any size, generated, with nothing stored.

A bucket's name is its shape:

* ``tree-{D}x{F}``: D directories of F objects each, keys
  ``d00000/f0000000.jpg`` (fixed-width, so the key order is the index order);
* ``flat-{N}``: N objects in one prefix, keys ``flat/f0000000.jpg``.

Every key's size, ETag and bytes are functions of the key (:func:`size_of`,
:func:`etag_of`, :func:`content`), so a million objects cost nothing to set
up and a reader can check every byte it gets. A key that is not in the shape
answers 404 (NoSuchKey).

Answered: ListObjectsV2 and ListObjects (V1, which rclone uses) with prefix,
delimiter, max-keys, continuation token / start-after / marker and
``encoding-type=url``; HEAD and GET of objects (ranges, If-Match -> 412);
HEAD bucket and GetBucketLocation. Signatures are not checked. Listings come
from arithmetic: bisection over the virtual sorted key sequence, so any page
of any prefix costs O(page + log N).

``delay`` (seconds, per request, applied in the request's own thread)
emulates a remote region; ``list_delay`` overrides it for listings.

``GET /_stats`` answers the request counts per operation as JSON
(``?reset=1`` zeroes them); it is never delayed.

Use it in-process (:func:`serve`, a context manager yielding the endpoint URL
and the server) or as a process, whose CPU can then be accounted apart::

    python -m benchmarks.synthetic_s3 --port 0 --delay 0.07

which prints ``ready http://127.0.0.1:PORT`` once it listens.
"""

from __future__ import annotations

import argparse
import bisect
import contextlib
import hashlib
import json
import re
import sys
import threading
import time
import urllib.parse
from collections import Counter
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

LAST_MODIFIED_ISO = "2024-05-01T12:00:00.000Z"
LAST_MODIFIED_HTTP = "Wed, 01 May 2024 12:00:00 GMT"
LAST_MODIFIED_EPOCH = 1714564800.0

_TREE_RE = re.compile(r"^tree-(\d+)x(\d+)$")
_FLAT_RE = re.compile(r"^flat-(\d+)$")


class Shape:
    """The sorted, virtual key sequence of one bucket (``len``, ``[i]``, :meth:`index`)."""

    def __len__(self) -> int:
        raise NotImplementedError

    def __getitem__(self, i: int) -> str:
        raise NotImplementedError

    def index(self, key: str) -> int | None:
        """The position of ``key``, or None when the bucket has no such key."""
        raise NotImplementedError


class Tree(Shape):
    def __init__(self, dirs: int, files: int) -> None:
        self.dirs, self.files = dirs, files
        self._re = re.compile(r"^d(\d{5})/f(\d{7})\.jpg$")

    def __len__(self) -> int:
        return self.dirs * self.files

    def __getitem__(self, i: int) -> str:
        if not 0 <= i < len(self):
            raise IndexError(i)
        d, f = divmod(i, self.files)
        return f"d{d:05d}/f{f:07d}.jpg"

    def index(self, key: str) -> int | None:
        m = self._re.match(key)
        if not m:
            return None
        d, f = int(m.group(1)), int(m.group(2))
        return d * self.files + f if d < self.dirs and f < self.files else None


class Flat(Shape):
    def __init__(self, n: int) -> None:
        self.n = n
        self._re = re.compile(r"^flat/f(\d{7})\.jpg$")

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> str:
        if not 0 <= i < self.n:
            raise IndexError(i)
        return f"flat/f{i:07d}.jpg"

    def index(self, key: str) -> int | None:
        m = self._re.match(key)
        return int(m.group(1)) if m and int(m.group(1)) < self.n else None


def shape_of(bucket: str) -> Shape | None:
    m = _TREE_RE.match(bucket)
    if m:
        return Tree(int(m.group(1)), int(m.group(2)))
    m = _FLAT_RE.match(bucket)
    if m:
        return Flat(int(m.group(1)))
    return None


def size_of(key: str) -> int:
    """1 KiB .. ~193 KiB, spread like small images."""
    h = int.from_bytes(hashlib.blake2b(key.encode(), digest_size=4).digest(), "little")
    return 1024 + h % (192 * 1024)


def etag_of(key: str) -> str:
    return hashlib.md5(key.encode()).hexdigest()


def content(key: str, start: int = 0, end: int | None = None) -> bytes:
    """Bytes [start, end) of ``key``: its 32-byte SHA-256 repeated."""
    size = size_of(key)
    end = size if end is None else min(end, size)
    if start >= end:
        return b""
    pattern = hashlib.sha256(key.encode()).digest()
    first = start - start % 32
    reps = (end - first + 31) // 32
    return (pattern * reps)[start - first:end - first]


def list_entries(keys: Shape, prefix: str, delimiter: str, after: str | None,
                 max_keys: int) -> tuple[list[tuple[bool, str]], bool]:
    """Up to ``max_keys`` entries (is_prefix, text) of a listing, in order, starting after
    ``after`` (a key or a common prefix); returns (entries, truncated)."""
    n = len(keys)
    i = bisect.bisect_left(keys, prefix)
    if after is not None and after >= prefix:
        i = max(i, bisect.bisect_right(keys, after))
        if delimiter and after.endswith(delimiter) and after.startswith(prefix):
            # Resuming after a common prefix: skip the keys that roll up into it.
            if i < n and keys[i].startswith(after):
                i = bisect.bisect_left(keys, after[:-1] + chr(ord(delimiter[-1]) + 1))
    out: list[tuple[bool, str]] = []
    while i < n and len(out) < max_keys:
        k = keys[i]
        if not k.startswith(prefix):
            return out, False
        if delimiter:
            j = k.find(delimiter, len(prefix))
            if j >= 0:
                cp = k[:j + len(delimiter)]
                out.append((True, cp))
                i = bisect.bisect_left(keys, cp[:-1] + chr(ord(cp[-1]) + 1))
                continue
        out.append((False, k))
        i += 1
    return out, i < n and keys[i].startswith(prefix)


def _xml_escape(s: str) -> str:
    return s.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


class SyntheticS3(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 256

    def __init__(self, addr: tuple[str, int], *, delay: float = 0.0,
                 list_delay: float | None = None) -> None:
        super().__init__(addr, _Handler)
        self.delay = delay
        self.list_delay = delay if list_delay is None else list_delay
        self.counts: Counter[str] = Counter()
        self.lock = threading.Lock()
        # Tests: while this event is clear, listings wait for it (at most a minute).
        self.list_gate: threading.Event | None = None

    def count(self, op: str) -> None:
        with self.lock:
            self.counts[op] += 1

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        return f"http://{host}:{port}"


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: SyntheticS3

    def log_message(self, format: str, *args: Any) -> None:  # quiet
        pass

    # -- plumbing ------------------------------------------------------------------
    def _send(self, status: int, body: bytes = b"", headers: dict[str, str] | None = None,
              content_type: str = "application/xml", length: int | None = None) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body) if length is None else length))
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.end_headers()
        if self.command != "HEAD" and body:
            self.wfile.write(body)

    def _error(self, status: int, code: str, message: str = "") -> None:
        body = (f'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>{code}</Code>'
                f"<Message>{_xml_escape(message or code)}</Message></Error>").encode()
        self._send(status, body)

    def _parse(self) -> tuple[str, str, dict[str, str]]:
        url = urllib.parse.urlsplit(self.path)
        path = urllib.parse.unquote(url.path)
        query = {k: v[0] for k, v in urllib.parse.parse_qs(url.query, keep_blank_values=True).items()}
        bucket, _, key = path.lstrip("/").partition("/")
        return bucket, key, query

    def _delay(self, op: str) -> None:
        d = self.server.list_delay if op.startswith("list") else self.server.delay
        if d > 0:
            time.sleep(d)
        gate = self.server.list_gate
        if gate is not None and op.startswith("list"):
            gate.wait(60)

    # -- methods --------------------------------------------------------------------
    def do_HEAD(self) -> None:
        bucket, key, _ = self._parse()
        op = "head" if key else "head_bucket"
        self.server.count(op)
        self._delay(op)
        shape = shape_of(bucket)
        if shape is None:
            return self._send(404)
        if not key:
            return self._send(200)
        if shape.index(key) is None:
            return self._send(404)
        self._send(200, headers=self._object_headers(key, size_of(key)),
                   content_type="application/octet-stream", length=size_of(key))

    def do_GET(self) -> None:
        bucket, key, query = self._parse()
        if bucket == "_stats":
            with self.server.lock:
                body = json.dumps(dict(self.server.counts)).encode()
                if "reset" in query:
                    self.server.counts.clear()
            return self._send(200, body, content_type="application/json")
        if not key:
            if "location" in query:
                op = "location"
            else:
                op = "list_v2" if query.get("list-type") == "2" else "list_v1"
        else:
            op = "get"
        self.server.count(op)
        self._delay(op)
        shape = shape_of(bucket)
        if shape is None:
            return self._error(404, "NoSuchBucket", f"bucket {bucket} does not exist")
        if op == "location":
            return self._send(200, b'<?xml version="1.0" encoding="UTF-8"?>\n<LocationConstraint/>')
        if op.startswith("list"):
            return self._list(bucket, shape, query, v2=op == "list_v2")
        self._get(shape, key)

    def do_PUT(self) -> None:
        self._error(403, "AccessDenied", "synthetic buckets are read-only")

    do_POST = do_DELETE = do_PUT

    # -- objects --------------------------------------------------------------------
    @staticmethod
    def _object_headers(key: str, size: int) -> dict[str, str]:
        return {"ETag": f'"{etag_of(key)}"', "Last-Modified": LAST_MODIFIED_HTTP,
                "Accept-Ranges": "bytes"}

    def _get(self, shape: Shape, key: str) -> None:
        if shape.index(key) is None:
            return self._error(404, "NoSuchKey", f"{key} does not exist")
        size = size_of(key)
        etag = etag_of(key)
        if_match = self.headers.get("If-Match")
        if if_match and if_match not in ("*", f'"{etag}"', etag):
            return self._error(412, "PreconditionFailed", "If-Match failed")
        headers = self._object_headers(key, size)
        rng = self.headers.get("Range")
        if not rng:
            return self._send(200, content(key), headers, "application/octet-stream")
        m = re.match(r"bytes=(\d*)-(\d*)$", rng.strip())
        if not m or (m.group(1) == "" and m.group(2) == ""):
            return self._error(400, "InvalidArgument", f"bad range {rng}")
        if m.group(1) == "":
            start, end = max(0, size - int(m.group(2))), size
        else:
            start = int(m.group(1))
            end = size if m.group(2) == "" else min(size, int(m.group(2)) + 1)
        if start >= size:
            return self._error(416, "InvalidRange", "range not satisfiable")
        headers["Content-Range"] = f"bytes {start}-{end - 1}/{size}"
        self._send(206, content(key, start, end), headers, "application/octet-stream")

    # -- listings -------------------------------------------------------------------
    def _list(self, bucket: str, shape: Shape, q: dict[str, str], *, v2: bool) -> None:
        prefix = q.get("prefix", "")
        delimiter = q.get("delimiter", "")
        try:
            max_keys = max(0, min(1000, int(q.get("max-keys", "1000") or 1000)))
        except ValueError:
            return self._error(400, "InvalidArgument", "max-keys")
        url = q.get("encoding-type") == "url"
        enc = (lambda s: urllib.parse.quote(s, safe="/")) if url else _xml_escape
        if v2:
            token = q.get("continuation-token")
            after = q.get("start-after") or None
            if token:
                after = urllib.parse.unquote(token[1:]) if token.startswith("k") else None
                if after is None:
                    return self._error(400, "InvalidArgument", "bad continuation token")
        else:
            after = q.get("marker") or None
        entries, truncated = list_entries(shape, prefix, delimiter, after, max_keys)
        parts = ['<?xml version="1.0" encoding="UTF-8"?>\n'
                 '<ListBucketResult xmlns="http://s3.amazonaws.com/doc/2006-03-01/">',
                 f"<Name>{bucket}</Name><Prefix>{enc(prefix)}</Prefix>"]
        if v2:
            parts.append(f"<KeyCount>{len(entries)}</KeyCount>")
            if q.get("continuation-token"):
                parts.append(f"<ContinuationToken>{_xml_escape(q['continuation-token'])}"
                             "</ContinuationToken>")
            if q.get("start-after"):
                parts.append(f"<StartAfter>{enc(q['start-after'])}</StartAfter>")
        else:
            parts.append(f"<Marker>{enc(q.get('marker', ''))}</Marker>")
        parts.append(f"<MaxKeys>{max_keys}</MaxKeys>")
        if delimiter:
            parts.append(f"<Delimiter>{enc(delimiter)}</Delimiter>")
        if url:
            parts.append("<EncodingType>url</EncodingType>")
        parts.append(f"<IsTruncated>{'true' if truncated else 'false'}</IsTruncated>")
        if truncated and entries:
            last = entries[-1][1]
            if v2:
                token = "k" + urllib.parse.quote(last, safe="")
                parts.append(f"<NextContinuationToken>{token}</NextContinuationToken>")
            elif delimiter:
                parts.append(f"<NextMarker>{enc(last)}</NextMarker>")
        prefixes = []
        for is_prefix, text in entries:
            if is_prefix:
                prefixes.append(f"<CommonPrefixes><Prefix>{enc(text)}</Prefix></CommonPrefixes>")
                continue
            parts.append(
                f"<Contents><Key>{enc(text)}</Key><LastModified>{LAST_MODIFIED_ISO}</LastModified>"
                f"<ETag>&quot;{etag_of(text)}&quot;</ETag><Size>{size_of(text)}</Size>"
                "<StorageClass>STANDARD</StorageClass></Contents>")
        parts.extend(prefixes)
        parts.append("</ListBucketResult>")
        self._send(200, "".join(parts).encode())


@contextlib.contextmanager
def serve(delay: float = 0.0, list_delay: float | None = None,
          port: int = 0) -> Iterator[SyntheticS3]:
    """Run a server in a thread of this process for the block's duration."""
    server = SyntheticS3(("127.0.0.1", port), delay=delay, list_delay=list_delay)
    thread = threading.Thread(target=server.serve_forever, name="synthetic-s3", daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()
        thread.join(10)


def stats(url: str, reset: bool = False) -> dict[str, int]:
    """The request counts of a running server (``reset`` zeroes them after reading)."""
    import urllib.request

    with urllib.request.urlopen(f"{url}/_stats{'?reset=1' if reset else ''}", timeout=30) as r:
        return {k: int(v) for k, v in json.loads(r.read()).items()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.synthetic_s3", description=__doc__.split("\n")[0])
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--delay", type=float, default=0.0, help="seconds added to every request")
    p.add_argument("--list-delay", type=float, default=None, help="seconds added to listings (default: --delay)")
    args = p.parse_args(argv)
    server = SyntheticS3(("127.0.0.1", args.port), delay=args.delay, list_delay=args.list_delay)
    print(f"ready {server.url}", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
