"""Mounting from a manifest: the index built from a file, with no LIST at all.

``cachefs mount ... --manifest FILE`` reads the objects of the mount from FILE
instead of listing the bucket. Objects not in it are not visible; an object in
it that is gone from the bucket reads as ENOENT (and logs why). Formats:

* JSON lines: ``{"key": ..., "size": ..., "etag": ..., "mtime": ...}`` per
  line (``mtime`` optional: epoch seconds or ISO 8601; the S3 spellings
  ``Key``, ``Size``, ``ETag``, ``LastModified`` are accepted too);
* CSV: ``key,size,etag[,mtime]`` rows, with or without a header row (a header
  may put the columns in any order); this is what ``cachefs manifest export``
  writes;
* an S3 Inventory report: its ``manifest.json``. CSV reports (gzip) need
  nothing more; Parquet and ORC reports need pyarrow (``pip install
  'cachefs[parquet]'``). The data files are read next to the manifest as S3
  delivers them (``data/`` beside the dated folder, or beside the manifest),
  checked against the manifest's MD5s; keys are URL-decoded, and only current
  versions that are not delete markers count.

Loading streams the file into LMDB (no per-object Python memory): names go to
a scratch table keyed by directory and name, which is then copied directory by
directory, in name order, into the index (appends, full pages). A mount over
the same cache directory with the same, unchanged manifest skips the load.
"""

from __future__ import annotations

import csv
import datetime
import gzip
import hashlib
import io
import json
import logging
import math
import os
import re
import time
import urllib.parse
import zlib
from collections import Counter
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from cachefs import metrics
from cachefs.cache.index import (
    ENTRY,
    F_DIR,
    LISTING,
    Entry,
    Index,
    enc,
    pack_entry,
    parent_prefix,
    prefix_id,
    unpack_entry,
)
from cachefs.cache.lmdbenv import LmdbEnv
from cachefs.cache.metadata import invalid_name_reason
from cachefs.errors import ConfigError
from cachefs.s3.store import ObjectInfo

log = logging.getLogger(__name__)

BATCH = 20_000  # records per write transaction
#: The largest size a manifest may give (a file's offsets are signed 64-bit; S3's own
#: limit is far below).
MAX_SIZE = (1 << 63) - 1


# -- reading -----------------------------------------------------------------------------
def _mtime(value: Any) -> float:
    if value is None or value == "":
        return 0.0
    if isinstance(value, bool):
        raise ValueError(f"invalid mtime {value!r}")
    if isinstance(value, (int, float)):
        return _finite_mtime(float(value))
    text = str(value).strip()
    try:
        number = float(text)
    except ValueError:
        pass
    else:
        return _finite_mtime(number)
    try:
        return datetime.datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()
    except ValueError:
        raise ValueError(f"invalid mtime {text!r}") from None


def _finite_mtime(value: float) -> float:
    if not math.isfinite(value):
        raise ValueError(f"invalid mtime {value!r}")
    return value


_DIGITS = re.compile(r"\s*[0-9]+\s*")


def _size(value: Any) -> int:
    """A size as JSON or CSV gives it: a whole number (not true, 7.9 or 1e3)."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)  # (1234.0: a float column written out)
    if isinstance(value, str) and _DIGITS.fullmatch(value):
        return int(value)
    raise ValueError(f"invalid size {value!r}: expected a whole number of bytes")


def _etag(value: Any) -> str:
    if value is None:
        return ""
    if not isinstance(value, str):
        raise ValueError(f"invalid ETag {value!r}: expected a string")
    return value.strip('"')


def _record(key: Any, size: Any, etag: Any, mtime: Any, where: str) -> ObjectInfo:
    if not isinstance(key, str) or not key:
        raise ConfigError(f"{where}: missing key")
    try:
        obj = ObjectInfo(key, _size(size), _etag(etag), _mtime(mtime))
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{where}: {exc}") from None
    if not 0 <= obj.size <= MAX_SIZE:
        raise ConfigError(f"{where}: invalid size {obj.size} (0 to {MAX_SIZE} bytes)")
    return obj


def _jsonl(f: Iterable[str], name: str) -> Iterator[ObjectInfo]:
    for n, line in enumerate(f, 1):
        if not line.strip():
            continue
        where = f"{name} line {n}"
        try:
            d = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{where}: not JSON ({exc.msg})") from None
        if not isinstance(d, dict):
            raise ConfigError(f"{where}: expected an object")
        yield _record(d.get("key", d.get("Key")), d.get("size", d.get("Size")),
                      d.get("etag", d.get("ETag", "")),
                      d.get("mtime", d.get("LastModified")), where)


_COLUMNS = ("key", "size", "etag", "mtime")


def _csv(f: Iterable[str], name: str) -> Iterator[ObjectInfo]:
    rows = csv.reader(f)
    order: tuple[int, ...] = (0, 1, 2, 3)
    for n, row in enumerate(rows, 1):
        if not row:
            continue
        if n == 1 and {c.strip().lower() for c in row} >= {"key", "size"}:
            cols = [c.strip().lower() for c in row]
            order = tuple(cols.index(c) if c in cols else -1 for c in _COLUMNS)
            continue
        where = f"{name} line {n}"
        vals = [row[i] if 0 <= i < len(row) else "" for i in order]
        if len(row) < 2:
            raise ConfigError(f"{where}: expected key,size,etag[,mtime]")
        yield _record(vals[0], vals[1], vals[2], vals[3], where)


def _open_text(path: Path) -> io.TextIOBase:
    raw = path.open("rb")
    head = raw.peek(2)[:2] if hasattr(raw, "peek") else b""
    if head == b"\x1f\x8b":
        return io.TextIOWrapper(gzip.GzipFile(fileobj=raw), encoding="utf-8", newline="")
    return io.TextIOWrapper(raw, encoding="utf-8", newline="")


def read_manifest(path: Path, bucket: str) -> Iterator[ObjectInfo]:
    """The objects a manifest file lists (any of the formats above)."""
    if not path.is_file():
        raise ConfigError(f"manifest {path} does not exist")
    if path.name.endswith("manifest.json"):
        try:
            doc = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise ConfigError(f"manifest {path}: {exc}") from None
        if isinstance(doc, dict) and "files" in doc and "fileSchema" in doc:
            yield from _inventory(path, doc, bucket)
            return
    try:
        with _open_text(path) as f:
            first = f.readline()
            f.seek(0)
            yield from (_jsonl if first.lstrip().startswith("{") else _csv)(f, str(path))
    except UnicodeDecodeError:
        raise ConfigError(f"manifest {path} is not UTF-8 text (JSON lines or CSV)") from None
    except (EOFError, zlib.error, gzip.BadGzipFile) as exc:  # (BadGzipFile is an OSError)
        raise ConfigError(f"manifest {path} is not a readable gzip file (cut short or "
                          f"damaged: {exc})") from None
    except OSError as exc:
        raise ConfigError(f"cannot read manifest {path}: {exc.strerror}") from None


# -- S3 Inventory ---------------------------------------------------------------------------
def _inventory_file(manifest: Path, key: str) -> Path:
    base = key.rsplit("/", 1)[-1]
    d = manifest.parent
    for cand in (d / base, d / "data" / base, d.parent / "data" / base):
        if cand.is_file():
            return cand
    raise ConfigError(f"inventory data file {base} (of {manifest}) not found in {d}, {d / 'data'} "
                      f"or {d.parent / 'data'}: copy the inventory's folder as S3 delivered it")


def _md5(path: Path) -> str:
    h = hashlib.md5()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _inventory(manifest: Path, doc: dict[str, Any], bucket: str) -> Iterator[ObjectInfo]:
    source = doc.get("sourceBucket")
    if source and source != bucket:
        raise ConfigError(f"inventory {manifest} is of bucket {source!r}, not {bucket!r}")
    fmt = str(doc.get("fileFormat", "CSV")).upper()
    schema = [c.strip() for c in str(doc["fileSchema"]).split(",")]
    for col in ("Key", "Size"):
        if col not in schema:
            raise ConfigError(f"inventory {manifest}: fileSchema has no {col} field")
    for item in doc["files"]:
        path = _inventory_file(manifest, item["key"])
        want = item.get("MD5checksum")
        if want and _md5(path) != want:
            raise ConfigError(f"inventory data file {path} does not match its MD5 in {manifest}")
        rows = _csv_rows(path, schema) if fmt == "CSV" else _arrow_rows(path, fmt, manifest)
        for n, row in enumerate(rows, 1):
            if str(row.get("IsLatest", "true")).lower() in ("false", "0"):
                continue
            if str(row.get("IsDeleteMarker", "false")).lower() in ("true", "1"):
                continue
            key = row["Key"]
            if fmt == "CSV":
                key = urllib.parse.unquote_plus(key)
            yield _record(key, row.get("Size") or 0, row.get("ETag", ""),
                          row.get("LastModifiedDate"), f"{path} row {n}")


def _csv_rows(path: Path, schema: list[str]) -> Iterator[dict[str, Any]]:
    with _open_text(path) as f:
        for row in csv.reader(f):
            if row:
                yield dict(zip(schema, row, strict=False))


def _arrow_rows(path: Path, fmt: str, manifest: Path) -> Iterator[dict[str, Any]]:
    try:
        import pyarrow.orc as orc  # type: ignore[import-not-found]
        import pyarrow.parquet as pq  # type: ignore[import-not-found]
    except ImportError:
        raise ConfigError(f"inventory {manifest} is {fmt}: reading it needs pyarrow "
                          "(pip install 'cachefs[parquet]'), or deliver the inventory as CSV"
                          ) from None
    if fmt == "PARQUET":
        batches = pq.ParquetFile(path).iter_batches(batch_size=65536)
    elif fmt == "ORC":
        batches = orc.ORCFile(path).read().to_batches(65536)
    else:
        raise ConfigError(f"inventory {manifest}: unknown fileFormat {fmt!r}")
    for batch in batches:
        cols = {name.lower(): batch.column(i).to_pylist()
                for i, name in enumerate(batch.schema.names)}
        names = {"bucket": "Bucket", "key": "Key", "size": "Size", "etag": "ETag",
                 "last_modified_date": "LastModifiedDate", "lastmodifieddate": "LastModifiedDate",
                 "is_latest": "IsLatest", "islatest": "IsLatest",
                 "is_delete_marker": "IsDeleteMarker", "isdeletemarker": "IsDeleteMarker"}
        present = {names[c]: v for c, v in cols.items() if c in names}
        for i in range(batch.num_rows):
            row = {k: v[i] for k, v in present.items()}
            lm = row.get("LastModifiedDate")
            if isinstance(lm, datetime.datetime):
                row["LastModifiedDate"] = lm.timestamp() if lm.tzinfo else \
                    lm.replace(tzinfo=datetime.UTC).timestamp()
            elif isinstance(lm, int):  # milliseconds since the epoch
                row["LastModifiedDate"] = lm / 1000
            yield row


# -- loading ------------------------------------------------------------------------------------
def identity(path: Path, root_prefix: str) -> bytes:
    st = path.stat()
    return f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}|{root_prefix}".encode()


def load(env: LmdbEnv, path: Path, *, bucket: str, root_prefix: str) -> int:
    """Make the index hold exactly the manifest's objects under ``root_prefix``; returns
    how many objects it holds. Skipped when the same manifest was loaded last time."""
    ident = identity(path, root_prefix)
    meta = env.db("meta")
    with env.read() as txn:
        if txn.get(b"manifest", db=meta) == ident:
            raw = txn.get(b"manifest-objects", db=meta)
            n = int(raw) if raw else 0
            log.info("manifest %s unchanged since the last mount: %d objects", path, n)
            return n
    t0 = time.monotonic()
    for name in ("listings", "names", "inodes", "stage"):
        env.drop(name)
    with env.write() as txn:
        txn.delete(b"manifest", db=meta)
    stage = env.db("stage")
    dirs: set[str] = {root_prefix}
    skipped: Counter[str] = Counter()
    objects = outside = 0

    def flush(batch: list[tuple[bytes, bytes, bool]]) -> None:
        with env.write() as txn:
            for key, value, is_dir in batch:
                if is_dir:
                    old = txn.get(key, db=stage)
                    if old is not None and not ENTRY.unpack_from(old)[0] & F_DIR:
                        skipped["shadowed"] += 1
                    txn.put(key, value, db=stage)
                elif not txn.put(key, value, overwrite=False, db=stage):
                    old = txn.get(key, db=stage)
                    skipped["shadowed" if ENTRY.unpack_from(old)[0] & F_DIR else "duplicate"] += 1

    batch: list[tuple[bytes, bytes, bool]] = []
    for obj in read_manifest(path, bucket):
        key = obj.key
        if not key.startswith(root_prefix) or key == root_prefix:
            outside += 1
            continue
        parent = key[:key.rfind("/") + 1]
        name = key[len(parent):]
        parts = key[len(root_prefix):].split("/")
        checked = parts[:-1] if name == "" else parts
        bad = next(((i, r) for i, r in enumerate(map(invalid_name_reason, checked)) if r),
                   None)
        if bad is not None:
            at, reason = bad
            skipped[reason] += 1
            # Its folders down to the first name that cannot be one still show (empty
            # when it is all they hold), as a listing shows them: S3 lists the folder.
            parent = root_prefix + "".join(f"{p}/" for p in parts[:min(at, len(parts) - 1)])
        elif name:  # (a key ending in "/" is a directory marker: only its directories)
            batch.append((prefix_id(parent) + enc(name),
                          pack_entry(0, obj.size, obj.mtime, 0, obj.etag), False))
            objects += 1
        d = parent
        while d not in dirs and len(d) > len(root_prefix):  # new directories up the tree
            dirs.add(d)
            up = parent_prefix(d)
            batch.append((prefix_id(up) + enc(d[len(up):-1]), pack_entry(F_DIR, 0, 0, 0, ""), True))
            d = up
        if len(batch) >= BATCH:
            flush(batch)
            batch = []
            if objects % 1_000_000 < BATCH:
                log.info("manifest %s: %d objects read", path, objects)
    flush(batch)
    _copy_stage(env, Index(env), sorted(dirs))
    env.drop("stage")
    for reason, n in skipped.items():
        metrics.SKIPPED_KEYS.labels(reason).inc(n)
        log.info("manifest %s: skipped %d key(s) (%s)", path, n, reason)
    if outside:
        log.info("manifest %s: %d key(s) outside s3://%s/%s ignored", path, outside, bucket,
                 root_prefix)
    with env.write() as txn:
        txn.put(b"manifest", ident, db=meta)
        txn.put(b"manifest-objects", str(objects).encode(), db=meta)
    log.info("manifest %s: %d objects in %d directories loaded in %.1fs", path, objects,
             len(dirs), time.monotonic() - t0)
    return objects


def _copy_stage(env: LmdbEnv, index: Index, dirs: list[str]) -> None:
    """Copy each directory's staged names, in name order, into a new version of it
    (several directories per transaction, a large one in chunks)."""
    stage = env.db("stage")
    listings = env.db("listings")

    def copy_one(txn: Any, prefix: str) -> int:
        pid = prefix_id(prefix)
        version = index.next_version(txn)
        cur = txn.cursor(db=stage)
        added = subdirs = 0
        last: bytes | None = None
        chunk: list[Entry] = []
        more = cur.set_range(pid)
        while True:
            if more and cur.key().startswith(pid) and len(chunk) < BATCH:
                chunk.append(unpack_entry(bytes(cur.key()[8:]), cur.value()))
                more = cur.next()
                continue
            if chunk:
                n, d, last, _ = index.write_entries(txn, prefix, version, chunk, last)
                added, subdirs, chunk = added + n, subdirs + d, []
            if not (more and cur.key().startswith(pid)):
                break
        txn.put(pid, LISTING.pack(version, time.time(), added, subdirs) + enc(prefix),
                db=listings)
        return added + 1

    i = 0
    while i < len(dirs):
        with env.write() as txn:  # a fresh transaction now and then bounds its dirty pages
            pending = 0
            while i < len(dirs) and pending < BATCH:
                pending += copy_one(txn, dirs[i])
                i += 1


def check_path(value: str) -> Path:
    path = Path(os.path.expanduser(value))
    if not path.is_file():
        raise ConfigError(f"manifest {value} does not exist or is not a file")
    return path
