"""Manifest mounts: the formats, the load into the index, and a real mount that never lists."""

from __future__ import annotations

import errno
import gzip
import hashlib
import io
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import trio

from cachefs.cache import manifest
from cachefs.cache.lmdbenv import LmdbEnv
from cachefs.cache.metadata import Metadata
from cachefs.errors import ConfigError
from cachefs.s3.memory import MemoryStore
from cachefs.s3.store import ObjectInfo

E1 = "0123456789abcdef0123456789abcdef"


def objs(path: Path, bucket: str = "b") -> list[ObjectInfo]:
    return list(manifest.read_manifest(path, bucket))


# -- formats -----------------------------------------------------------------------------------
def test_jsonl_with_both_spellings_and_optional_mtime(tmp_path: Path) -> None:
    p = tmp_path / "m.jsonl"
    p.write_text(
        json.dumps({"key": "d/a.jpg", "size": 3, "etag": E1, "mtime": 1700000000}) + "\n\n"
        + json.dumps({"Key": "d/b.jpg", "Size": "4", "ETag": '"x-2"',
                      "LastModified": "2024-05-01T12:00:00.000Z"}) + "\n"
        + json.dumps({"key": "c", "size": 0, "etag": ""}) + "\n")
    got = objs(p)
    assert got == [ObjectInfo("d/a.jpg", 3, E1, 1700000000.0),
                   ObjectInfo("d/b.jpg", 4, "x-2", 1714564800.0),
                   ObjectInfo("c", 0, "", 0.0)]


def test_csv_with_and_without_header(tmp_path: Path) -> None:
    bare = tmp_path / "bare.csv"
    bare.write_text(f'd/a.jpg,3,{E1}\n"odd, name.jpg",5,"e2",1700000001.5\n')
    assert objs(bare) == [ObjectInfo("d/a.jpg", 3, E1, 0.0),
                          ObjectInfo("odd, name.jpg", 5, "e2", 1700000001.5)]
    headed = tmp_path / "headed.csv"
    headed.write_text(f"etag,key,size\n{E1},d/a.jpg,3\n")  # any column order with a header
    assert objs(headed) == [ObjectInfo("d/a.jpg", 3, E1, 0.0)]
    gz = tmp_path / "m.csv.gz"
    gz.write_bytes(gzip.compress(f"key,size,etag\nx,1,{E1}\n".encode()))
    assert objs(gz) == [ObjectInfo("x", 1, E1, 0.0)]


@pytest.mark.parametrize("text, message", [
    ("d/a.jpg,notanumber,e\n", "line 1"),
    ('{"key": "a", "size": 1}\n{broken\n', "line 2: not JSON"),
    ('{"size": 1}\n', "missing key"),
    ("onlykey\n", "expected key,size"),
])
def test_bad_manifest_is_one_clear_error(tmp_path: Path, text: str, message: str) -> None:
    p = tmp_path / "bad.csv"
    p.write_text(text)
    with pytest.raises(ConfigError, match=message):
        objs(p)


@pytest.mark.parametrize("text, message", [
    ('{"key": "a", "size": true, "etag": "e"}\n', "line 1: invalid size True"),  # was 1 byte
    ('{"key": "a", "size": 7.9, "etag": "e"}\n', "line 1: invalid size 7.9"),  # was 7
    ('{"key": "a", "size": "12", "etag": 5}\n', "line 1: invalid ETag 5"),
    ('{"key": "a", "size": 1, "etag": "e", "mtime": true}\n', "line 1: invalid mtime True"),
    ("a,1e3,e\n", "line 1: invalid size '1e3'"),  # was int()'s own words
    ("a, 12 ,e\n", None),
], ids=["size-true", "size-fraction", "etag-number", "mtime-true", "size-1e3", "size-spaced"])
def test_a_manifest_value_of_the_wrong_type_is_refused(tmp_path: Path, text: str,
                                                       message: str | None) -> None:
    """JSON has types: a size given as true was a file of 1 byte, 7.9 one of 7 (reads then
    failed with ESTALE, the object being another size); a size CSV could not read was
    told in int()'s words. A size is a whole number, an ETag a string."""
    p = tmp_path / "m.csv"
    p.write_text(text)
    if message is None:
        assert objs(p) == [ObjectInfo("a", 12, "e", 0.0)]
        return
    with pytest.raises(ConfigError, match=re.escape(message)):
        objs(p)


def _inventory(tmp_path: Path, rows: list[list[str]], *, schema: str, bucket: str = "b",
               fmt: str = "CSV", data: bytes | None = None, md5: str | None = None) -> Path:
    """An S3 Inventory report laid out as S3 delivers it."""
    top = tmp_path / "inv" / bucket / "cfg"
    dated = top / "2024-05-02T01-00Z"
    (top / "data").mkdir(parents=True)
    dated.mkdir(parents=True)
    if data is None:
        buf = io.StringIO()
        import csv
        csv.writer(buf).writerows(rows)
        data = gzip.compress(buf.getvalue().encode())
    name = "f1b2.csv.gz" if fmt == "CSV" else "f1b2.parquet"
    (top / "data" / name).write_bytes(data)
    doc = {"sourceBucket": bucket, "destinationBucket": "arn:aws:s3:::inv", "version": "2016-11-30",
           "fileFormat": fmt, "fileSchema": schema,
           "files": [{"key": f"inv/{bucket}/cfg/data/{name}", "size": len(data),
                      "MD5checksum": md5 or hashlib.md5(data).hexdigest()}]}
    m = dated / "manifest.json"
    m.write_text(json.dumps(doc))
    return m


INV_SCHEMA = "Bucket, Key, VersionId, IsLatest, IsDeleteMarker, Size, LastModifiedDate, ETag"


def test_s3_inventory_csv(tmp_path: Path) -> None:
    rows = [
        ["b", "ds/a%20b.jpg", "", "true", "false", "3", "2024-05-01T12:00:00.000Z", E1],
        ["b", "ds/old.jpg", "v1", "false", "false", "9", "2024-05-01T12:00:00.000Z", "x"],
        ["b", "ds/deleted.jpg", "v2", "true", "true", "", "2024-05-01T12:00:00.000Z", ""],
        ["b", "ds/plus%2Bsign.jpg", "", "true", "false", "4", "2024-05-01T12:00:00.000Z", "e-2"],
    ]
    m = _inventory(tmp_path, rows, schema=INV_SCHEMA)
    assert objs(m) == [ObjectInfo("ds/a b.jpg", 3, E1, 1714564800.0),
                       ObjectInfo("ds/plus+sign.jpg", 4, "e-2", 1714564800.0)]
    with pytest.raises(ConfigError, match="of bucket 'b', not 'other'"):
        list(manifest.read_manifest(m, "other"))


def test_s3_inventory_checks_md5_and_finds_missing_files(tmp_path: Path) -> None:
    m = _inventory(tmp_path, [["b", "k", "3"]], schema="Bucket, Key, Size", md5="0" * 32)
    with pytest.raises(ConfigError, match="does not match its MD5"):
        objs(m)
    for f in (m.parent.parent / "data").iterdir():
        f.unlink()
    with pytest.raises(ConfigError, match="not found"):
        objs(m)


def test_s3_inventory_parquet(tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.table({
        "bucket": ["b", "b"], "key": ["ds/x.jpg", "ds/y.jpg"], "size": [5, 6],
        "last_modified_date": pa.array([1714564800000, 1714564801000], pa.timestamp("ms", tz="UTC")),
        "e_tag": [E1, E1], "is_latest": [True, False],
    })
    buf = io.BytesIO()
    pq.write_table(table, buf)
    m = _inventory(tmp_path, [], schema="Bucket, Key, Size, LastModifiedDate, ETag, IsLatest",
                   fmt="Parquet", data=buf.getvalue())
    assert objs(m) == [ObjectInfo("ds/x.jpg", 5, "", 1714564800.0)]


def test_parquet_without_pyarrow_is_a_clear_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    m = _inventory(tmp_path, [], schema="Bucket, Key, Size", fmt="Parquet", data=b"PAR1")
    monkeypatch.setitem(sys.modules, "pyarrow", None)
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    monkeypatch.setitem(sys.modules, "pyarrow.orc", None)
    with pytest.raises(ConfigError, match=r"needs pyarrow \(pip install 'cachefs\[parquet\]'\)"):
        objs(m)


# -- loading -------------------------------------------------------------------------------------
def test_load_builds_the_tree_and_nothing_is_listed(tmp_path: Path) -> None:
    p = tmp_path / "m.csv"
    lines = ["key,size,etag,mtime", f"ds/b/y.jpg,2,{E1},5", f"ds/a.jpg,1,{E1},5",
             f"ds/b/x.jpg,3,{E1},5", "ds/deep/er/z,4,e,5", "outside/q,1,e,5", "ds/b,9,e,5",
             "ds/bad//name,1,e,5", "ds/marker/,0,e,5"]
    p.write_text("\n".join(lines) + "\n")
    env = LmdbEnv(tmp_path / "meta.lmdb")
    store = MemoryStore()  # must never be asked
    try:
        md = Metadata(env, None, ttl=1, limiter=trio.CapacityLimiter(1))
        assert manifest.load(env, p, bucket="b", root_prefix="ds/") == 5

        async def body() -> None:
            async with trio.open_nursery() as nursery:
                await nursery.start(md.run)
                names = [(e.name, e.is_dir) for e in md.iter_entries("ds/")]
                # "ds/b" (also a directory) is shadowed, "ds/bad//name" is not a path
                # (its folder shows, empty, as a listing shows it)
                assert names == [(b"a.jpg", False), (b"b", True), (b"bad", True),
                                 (b"deep", True), (b"marker", True)]
                assert list(md.iter_entries("ds/bad/")) == []
                assert [e.name for e in md.iter_entries("ds/b/")] == [b"x.jpg", b"y.jpg"]
                x = await md.lookup("ds/b/", b"x.jpg")
                assert x is not None and (x.size, x.etag, x.mtime) == (3, E1, 5.0)
                assert md.resolve(x.ino) == ("ds/b/", x)
                assert await md.lookup("ds/", b"nope") is None
                assert await md.lookup("ds/nodir/", b"x") is None
                assert [e.name for e in md.iter_entries("ds/deep/er/")] == [b"z"]
                await md.ensure("ds/other/")  # no listing, no error: it does not exist
                assert md.is_fresh("ds/b/")
                nursery.cancel_scope.cancel()

        trio.run(body)
        assert store.calls["list"] == 0
        # The same manifest again: not reloaded; a changed one: reloaded.
        assert manifest.load(env, p, bucket="b", root_prefix="ds/") == 5
        time.sleep(0.01)
        p.write_text("key,size,etag\nds/only.jpg,1,e\n")
        os.utime(p, ns=(time.time_ns(), time.time_ns() + 10**9))
        assert manifest.load(env, p, bucket="b", root_prefix="ds/") == 1
        assert [e.name for e in md.iter_entries("ds/")] == [b"only.jpg"]
    finally:
        env.close()


# -- export --------------------------------------------------------------------------------------
def test_export_lists_everything_in_parallel(tmp_path: Path) -> None:
    from cachefs.cli.manifest import export

    store = MemoryStore(page_size=3)
    keys = [f"ds/d{d}/f{f}" for d in range(5) for f in range(4)] + ["ds/top", "ds/e/"]
    for k in keys:
        store.put(k, k.encode())
    out = io.StringIO()
    n, dirs = export(store, "ds/", out, parallel=3)
    assert n == len(keys) and dirs == 7
    p = tmp_path / "m.csv"
    p.write_text(out.getvalue())
    got = {o.key: o for o in objs(p)}
    assert set(got) == set(keys)
    assert got["ds/d1/f2"].etag == store.head("ds/d1/f2").etag and got["ds/d1/f2"].size == 8
    out = io.StringIO()
    export(store, "ds/d2/", out, fmt="jsonl")
    assert [json.loads(x)["key"] for x in out.getvalue().splitlines()] == [f"ds/d2/f{f}" for f in range(4)]


def test_export_retries_a_throttled_listing(bucket: Any, s3_endpoint: str) -> None:
    """'cachefs manifest export' of a bucket that answered one listing with 503 SlowDown
    (S3's throttling; routine on a large bucket listed in parallel) ended in a traceback
    (ValueError: Incorrect label count, from counting the retry) instead of retrying."""
    from tests.conftest import run_cachefs
    from tests.faultproxy import FaultProxy

    client, name = bucket
    keys = [f"ds/d{d}/f{f}" for d in range(3) for f in range(2)]
    for k in keys:
        client.put_object(Bucket=name, Key=k, Body=k.encode())
    lists = iter(range(10**6))
    with FaultProxy(s3_endpoint) as proxy:
        # The second and third listings are throttled; the rest go through.
        proxy.plan = lambda method, path, n: (
            "503" if method == "GET" and "list-type" in path and next(lists) in (1, 2)
            else "pass")
        proc = run_cachefs("manifest", "export", f"s3://{name}/ds", "--endpoint-url",
                           proxy.url, "--region", "us-east-1")
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr
    rows = proc.stdout.splitlines()[1:]
    assert sorted(r.split(",")[0] for r in rows) == keys


# -- a real mount ----------------------------------------------------------------------------------
@pytest.mark.fuse
def test_manifest_mount_never_lists(bucket: Any, mount_factory: Any, tmp_path: Path,
                                    s3_endpoint: str) -> None:
    client, name = bucket
    for k in ("ds/a/1.bin", "ds/a/2.bin", "ds/b/3.bin", "ds/hidden.bin", "ds/gone.bin"):
        client.put_object(Bucket=name, Key=k, Body=k.encode() * 3)
    env = dict(os.environ)
    proc = subprocess.run([sys.executable, "-m", "cachefs", "manifest", "export", f"s3://{name}/ds",
                           "--endpoint-url", s3_endpoint], capture_output=True, text=True,
                          timeout=60, env=env)
    assert proc.returncode == 0, proc.stderr
    assert "5 objects" in proc.stderr
    rows = [r for r in proc.stdout.splitlines() if "hidden" not in r]
    (tmp_path / "m.csv").write_text("\n".join(rows) + "\n")
    client.delete_object(Bucket=name, Key="ds/gone.bin")  # in the manifest, not in the bucket
    m = mount_factory(f"s3://{name}/ds", "--manifest", str(tmp_path / "m.csv"))
    assert sorted(os.listdir(m.path)) == ["a", "b", "gone.bin"]
    assert sorted(os.listdir(m.path / "a")) == ["1.bin", "2.bin"]
    assert (m.path / "b" / "3.bin").read_bytes() == b"ds/b/3.bin" * 3
    assert not (m.path / "hidden.bin").exists()
    with pytest.raises(OSError) as ei:
        (m.path / "gone.bin").read_bytes()
    assert ei.value.errno == errno.ENOENT
    assert m.metric('cachefs_s3_requests_total{op="list"}') == 0
    deadline = time.monotonic() + 10
    while "gone.bin is listed (or in the manifest) but no longer in the bucket" not in m.log():
        assert time.monotonic() < deadline, m.log()[-2000:]
        time.sleep(0.1)


@pytest.mark.fuse
def test_manifest_mount_with_a_missing_file_fails_in_one_line(bucket: Any, mount_factory: Any,
                                                              tmp_path: Path) -> None:
    _, name = bucket
    m = mount_factory(f"s3://{name}", "--manifest", str(tmp_path / "nope.csv"), start=False)
    from tests.conftest import run_cachefs

    proc = run_cachefs("mount", m.source, str(m.path), "--cache-dir", str(m.cache_dir),
                       "--endpoint-url", m.endpoint, "--manifest", str(tmp_path / "nope.csv"))
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0 and "does not exist" in proc.stderr


@pytest.mark.parametrize("data", [
    gzip.compress(f"key,size,etag\nd/a.bin,1,{E1}\n".encode(), mtime=0)[:-12],  # cut short
    b"\x1f\x8b\x08\x00" + b"not deflate data at all" * 4,  # gzip header, then junk
    b"\x1f\x8b\x07" + b"\x00" * 20,  # not a method gzip knows
])
def test_a_damaged_gzip_manifest_fails_the_mount_in_one_line(
        bucket: Any, mount_factory: Any, tmp_path: Path, data: bytes) -> None:
    """A manifest.csv.gz cut short (a copy that did not finish) or damaged crashed the daemon
    at start-up with an EOFError or zlib.error traceback in its log, and the command said
    only 'the daemon exited during start-up'; a bad header said 'cannot read manifest ...:
    None'."""
    from tests.conftest import is_mounted, run_cachefs

    _, name = bucket
    manifest = tmp_path / "m.csv.gz"
    manifest.write_bytes(data)
    m = mount_factory(f"s3://{name}", start=False)
    proc = run_cachefs("mount", m.source, str(m.path), "--cache-dir", str(m.cache_dir),
                       "--endpoint-url", m.endpoint, "--manifest", str(manifest))
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().count("\n") == 0, proc.stderr
    assert f"manifest {manifest} is not a readable gzip file" in proc.stderr, proc.stderr
    assert "None" not in proc.stderr and "Traceback" not in m.log()
    assert not is_mounted(m.path)


@pytest.mark.parametrize("row, field", [("-5,E1", "size"), (f"{1 << 64},E1", "size"),
                                        ("1,E1,nan", "mtime"), ("1,E1,inf", "mtime")])
def test_a_manifest_value_out_of_range_fails_the_mount_in_one_line(
        bucket: Any, mount_factory: Any, tmp_path: Path, row: str, field: str) -> None:
    """A size or time no object can have (a hand-made or corrupted manifest) was read as a
    number, then the daemon crashed storing it, with a traceback in its log and only 'the
    daemon exited during start-up' on the command's stderr."""
    from tests.conftest import is_mounted, run_cachefs

    client, name = bucket
    client.put_object(Bucket=name, Key="d/a.bin", Body=b"a")
    manifest = tmp_path / "m.csv"
    manifest.write_text(f"key,size,etag,mtime\nd/a.bin,1,{E1},0\n"
                        f"d/b.bin,{row.replace('E1', E1)}\n")
    m = mount_factory(f"s3://{name}", start=False)
    proc = run_cachefs("mount", m.source, str(m.path), "--cache-dir", str(m.cache_dir),
                       "--endpoint-url", m.endpoint, "--manifest", str(manifest))
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().count("\n") == 0, proc.stderr
    assert "line 3" in proc.stderr and field in proc.stderr, proc.stderr
    assert "Traceback" not in m.log()
    assert not is_mounted(m.path)


@pytest.mark.fuse
def test_a_manifest_size_the_object_does_not_have_fails_reads_at_once(
        bucket: Any, mount_factory: Any, tmp_path: Path) -> None:
    """A manifest with sizes wrong (hand-made, or made by another tool): the GET answers a
    complete object of another size. That was taken for a short body and retried until the
    retry deadline (5 minutes of a GET a second per read, the reader blocked), then EIO.
    The version the mount shows does not exist: ESTALE at once, with a log line naming
    both sizes."""
    client, name = bucket
    bodies = {"small.bin": b"s" * 1000, "big.bin": bytes(range(256)) * 1024,  # 4 blocks
              "grown.bin": b"g" * 3000, "right.bin": b"r" * 500}
    listed = {"small.bin": 5000, "big.bin": 300_000, "grown.bin": 2000, "right.bin": 500}
    rows = ["key,size,etag"]
    for key, body in bodies.items():
        client.put_object(Bucket=name, Key=key, Body=body)
        tag = client.head_object(Bucket=name, Key=key)["ETag"].strip('"')
        rows.append(f"{key},{listed[key]},{tag}")
    (tmp_path / "m.csv").write_text("\n".join(rows) + "\n")
    m = mount_factory(f"s3://{name}", "--manifest", str(tmp_path / "m.csv"),
                      "--block-size", "64K")
    assert (m.path / "right.bin").read_bytes() == b"r" * 500
    for key in ("small.bin", "big.bin", "grown.bin"):
        path = m.path / key
        assert path.stat().st_size == listed[key]
        # (in a child with a hang guard: the reader was blocked for the retry deadline)
        proc = subprocess.run(
            [sys.executable, "-c", "import sys\ntry:\n open(sys.argv[1], 'rb').read()\n"
             "except OSError as e:\n print(e.errno)", str(path)],
            capture_output=True, text=True, timeout=60)
        assert proc.stdout.strip() == str(errno.ESTALE), (key, proc.stdout, proc.stderr)
    log = m.log()
    assert "small.bin is 1000 bytes, not 5000 as the mount shows" in log, log[-3000:]
    assert "grown.bin is 3000 bytes, not 2000 as the mount shows" in log, log[-3000:]


def test_a_manifest_without_etags_reads_its_files(bucket: Any, mount_factory: Any,
                                                  tmp_path: Path) -> None:
    """S3 Inventory's ETag field is optional: rows without one name no version to pin, so
    the GETs carry no If-Match (``If-Match: *`` was sent, which S3-compatible servers
    answer 412: every read failed ESTALE)."""
    client, name = bucket
    bodies = {"a.bin": b"a" * 500, "d/b.bin": bytes(range(256)) * 1024}  # 1 and 4 blocks
    for key, body in bodies.items():
        client.put_object(Bucket=name, Key=key, Body=body)
    (tmp_path / "m.csv").write_text("".join(f"{k},{len(b)},\n" for k, b in bodies.items()))
    m = mount_factory(f"s3://{name}", "--manifest", str(tmp_path / "m.csv"),
                      "--block-size", "64K")
    for key, body in bodies.items():
        assert (m.path / key).read_bytes() == body, key


@pytest.mark.fuse
def test_folders_of_unusable_keys_show_alike_listed_or_from_a_manifest(
        bucket: Any, mount_factory: Any, tmp_path: Path) -> None:
    """A folder whose only keys cannot be file names (a name over 255 bytes, an empty or
    dot component) showed as an empty directory in a listed mount, as S3 lists the folder,
    but not at all in a mount from a manifest of the same keys: the same dataset had two
    trees. A manifest mount now shows the same empty folders, down to the first name that
    cannot be one."""
    from tests.test_mount import tree

    client, name = bucket
    keys = {"ds/ok/a.bin": b"a", "ds/long/" + "n" * 300: b"x", "ds/deep/er/" + "m" * 256: b"y",
            "ds/bad//double": b"z", "ds/dots/./here": b"w", "ds/up/../escape": b"v",
            "ds/" + "d" * 256 + "/inner": b"u", "ds/mixed/" + "o" * 300: b"t",
            "ds/mixed/fine.bin": b"s"}
    for key, body in keys.items():
        client.put_object(Bucket=name, Key=key, Body=body)
    rows = ["key,size,etag"]
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=name, Prefix="ds/"):
        for obj in page.get("Contents", []):
            rows.append(f"{obj['Key']},{obj['Size']},{obj['ETag'].strip(chr(34))}")
    assert len(rows) == len(keys) + 1
    (tmp_path / "m.csv").write_text("\n".join(rows) + "\n")
    listed = mount_factory(f"s3://{name}/ds")
    from_manifest = mount_factory(f"s3://{name}/ds", "--manifest", str(tmp_path / "m.csv"))
    dirs, files = tree(listed.path)
    assert dirs == {"ok", "long", "deep", "deep/er", "bad", "dots", "up", "mixed"}, dirs
    assert files == {"ok/a.bin", "mixed/fine.bin"}, files
    assert tree(from_manifest.path) == (dirs, files)
    assert from_manifest.metric('cachefs_s3_requests_total{op="list"}') == 0
