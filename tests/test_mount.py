"""Real-mount tests: a real cachefs daemon, a real FUSE mount, a real S3 server (moto)."""

from __future__ import annotations

import errno
import hashlib
import os
import random
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import is_mounted

pytestmark = pytest.mark.fuse

BLOCK = 64 * 1024  # small blocks so "large" objects span many blocks cheaply


def _payload(seed: int, size: int) -> bytes:
    rnd = random.Random(seed)
    return rnd.randbytes(size)


def populate(client: Any, bucket: str, prefix: str = "data/") -> dict[str, bytes]:
    """Objects a dataset bucket may hold, awkward ones included. Returns the visible files
    (relative path -> bytes) the mount must show."""
    files: dict[str, bytes] = {}
    for cls in range(3):
        for i in range(5):
            files[f"train/class{cls}/img{i:03d}.jpg"] = _payload(cls * 100 + i, 1000 + 937 * i)
    files["shards/shard-000.tar"] = _payload(1, 5 * BLOCK + 12345)  # > 3 blocks
    files["shards/shard-001.tar"] = _payload(2, 4 * BLOCK)  # exact multiple
    files["empty.bin"] = b""
    files["with space/ünïcödé name.txt"] = b"unicode key\n"
    files["deep/a/b/c/d/leaf.txt"] = b"deep\n"
    files["a"] = b"shadowed file"  # also a prefix below: the directory wins
    files["a/inner.txt"] = b"inner\n"
    for key, data in files.items():
        client.put_object(Bucket=bucket, Key=prefix + key, Body=data)
    # Awkward keys that must not crash the mount and are not files:
    client.put_object(Bucket=bucket, Key=prefix + "marker/", Body=b"")  # directory marker
    client.put_object(Bucket=bucket, Key=prefix + "bad//double-slash", Body=b"x")
    client.put_object(Bucket=bucket, Key=prefix + "dots/../escape", Body=b"x")
    client.put_object(Bucket=bucket, Key=prefix + "dots/./here", Body=b"x")
    client.put_object(Bucket=bucket, Key=prefix + "long/" + "n" * 300, Body=b"x")
    client.put_object(Bucket=bucket, Key="outside-prefix.txt", Body=b"not mounted")
    del files["a"]
    return files


def tree(root: Path) -> tuple[set[str], set[str]]:
    dirs, files = set(), set()
    for dirpath, dirnames, filenames in os.walk(root):
        rel = os.path.relpath(dirpath, root)
        for d in dirnames:
            dirs.add(os.path.normpath(os.path.join(rel, d)))
        for f in filenames:
            files.add(os.path.normpath(os.path.join(rel, f)))
    return dirs, files


def test_tree_and_bytes_match_the_bucket(bucket, mount_factory):
    client, name = bucket
    files = populate(client, name)
    m = mount_factory(f"s3://{name}/data", "--block-size", "64K")
    dirs, seen = tree(m.path)
    assert seen == set(files)
    assert {"train", "train/class0", "shards", "marker", "a", "deep/a/b/c/d", "with space",
            "bad", "dots", "long"} <= dirs
    for rel, data in files.items():
        p = m.path / rel
        assert p.stat().st_size == len(data), rel
        assert p.read_bytes() == data, rel
    # Nothing under "bad", "dots" or "long" can be a file name there.
    assert os.listdir(m.path / "bad") == [] and os.listdir(m.path / "long") == []
    skipped = m.metrics()
    assert skipped['cachefs_skipped_keys_total{reason="shadowed"}'] == 1
    assert skipped['cachefs_skipped_keys_total{reason="empty"}'] >= 1
    assert skipped['cachefs_skipped_keys_total{reason="too_long"}'] == 1
    assert skipped['cachefs_skipped_keys_total{reason="dot"}'] == 2
    st = (m.path / "train").stat()
    assert oct(st.st_mode & 0o777) == oct(0o555)
    assert oct((m.path / "empty.bin").stat().st_mode & 0o777) == oct(0o444)


def test_directories_show_the_mount_s_start_as_their_modification_time(bucket, mount_factory):
    """S3 keeps no time for a prefix: directories showed 0, 1 January 1970, to `ls -l`,
    `find -newer` and backup tools. They show the time the mount started (as Mountpoint
    for S3 does); files keep their objects' LastModified."""
    client, name = bucket
    client.put_object(Bucket=name, Key="d/e/a.bin", Body=b"a")
    before = time.time()
    m = mount_factory(f"s3://{name}")
    after = time.time()
    for d in (m.path, m.path / "d", m.path / "d" / "e"):
        assert before - 1 <= d.stat().st_mtime <= after + 1, d
    head = client.head_object(Bucket=name, Key="d/e/a.bin")["LastModified"].timestamp()
    assert abs((m.path / "d" / "e" / "a.bin").stat().st_mtime - head) < 1


@pytest.mark.parametrize("prefix", ["données/été", "データ", "a,b", "x\\y,z=w%41"])
def test_a_prefix_of_any_characters_mounts(bucket, mount_factory, prefix):
    """A source prefix is a key prefix: any characters S3 takes. One with a letter outside
    ASCII (a dataset's folder in French, Japanese...) failed the mount with a traceback in
    the log (the file system's name, the source, goes to libfuse's mount options, ASCII
    only), one with a comma with 'fuse_session_new() failed' (a comma splits options).
    The mount table shows the source with those characters %-escaped."""
    from urllib.parse import unquote

    client, name = bucket
    files = {"f.txt": b"one\n", "sub/g.bin": _payload(7, 3 * BLOCK + 5)}
    for key, data in files.items():
        client.put_object(Bucket=name, Key=f"{prefix}/{key}", Body=data)
    client.put_object(Bucket=name, Key=f"{prefix}-sibling/h.txt", Body=b"not mounted")
    m = mount_factory(f"s3://{name}/{prefix}", "--block-size", str(BLOCK))
    assert tree(m.path) == ({"sub"}, set(files))
    for key, data in files.items():
        assert (m.path / key).read_bytes() == data
    with open("/proc/self/mountinfo") as f:
        (source,) = [line.partition(" - ")[2].split()[1] for line in f
                     if line.split()[4] == str(m.path)]
    assert unquote(source) == f"s3://{name}/{prefix}/"
    assert "Traceback" not in m.log()


def test_a_cache_dir_holding_other_files_leaves_their_modes_alone(bucket, mount_factory,
                                                                 tmp_path):
    """--cache-dir given a directory that holds other things (a home, a project, /var/cache)
    had every entry at its top narrowed to 0700 (folders) and 0600 (files): scripts lost
    their execute bits, folders other users read were closed to them, and the directory
    itself was closed to them too. Only cachefs's own entries are narrowed now, and the
    directory only when it holds nothing else (its cache stays private: those entries are
    0700/0600); the log says what it left alone."""
    import stat

    client, name = bucket
    client.put_object(Bucket=name, Key="f.bin", Body=b"cached bytes")
    home = tmp_path / "home"
    (home / "project").mkdir(parents=True)
    (home / "run.sh").write_text("#!/bin/sh\necho hi\n")
    (home / "notes.txt").write_text("notes")
    modes = {"": 0o755, "project": 0o755, "run.sh": 0o755, "notes.txt": 0o644}
    for rel, mode in modes.items():
        (home / rel).chmod(mode)
    m = mount_factory(f"s3://{name}", cache_dir=home)
    assert (m.path / "f.bin").read_bytes() == b"cached bytes"
    for rel, mode in modes.items():
        got = stat.S_IMODE((home / rel).stat().st_mode)
        assert got == mode, f"{rel or 'the directory'}: {got:04o}, was {mode:04o}"
    for own in ("objects", "meta.lmdb", "lock", "cachefs.log"):
        got = stat.S_IMODE((home / own).stat().st_mode)
        assert got == (0o700 if (home / own).is_dir() else 0o600), (own, oct(got))
    assert "notes.txt" in m.log() and "Traceback" not in m.log()


def test_random_offset_reads_match_reference(bucket, mount_factory):
    client, name = bucket
    data = _payload(7, 7 * BLOCK + 999)
    client.put_object(Bucket=name, Key="obj.bin", Body=data)
    m = mount_factory(f"s3://{name}", "--block-size", "64K")
    rnd = random.Random(42)
    with open(m.path / "obj.bin", "rb", buffering=0) as f:
        for _ in range(300):
            off = rnd.randrange(0, len(data) + 100)
            size = rnd.choice([1, 17, 4096, BLOCK - 1, BLOCK, BLOCK + 1, 3 * BLOCK, 200_000])
            assert os.pread(f.fileno(), size, off) == data[off:off + size], (off, size)


def test_concurrent_readers_share_one_get_per_block(bucket, mount_factory):
    client, name = bucket
    data = _payload(9, 6 * BLOCK)
    client.put_object(Bucket=name, Key="shared.bin", Body=data)
    m = mount_factory(f"s3://{name}", "--block-size", "64K")
    results: list[bytes] = []

    def reader() -> None:
        with open(m.path / "shared.bin", "rb") as f:
            results.append(f.read())

    threads = [threading.Thread(target=reader) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == [data] * 8
    assert m.gets() == 6  # one GET per block, however many readers


def test_remount_reads_everything_with_zero_gets(bucket, mount_factory, tmp_path):
    client, name = bucket
    files = populate(client, name)
    m = mount_factory(f"s3://{name}/data", "--block-size", "64K")
    assert tree(m.path)[1] == set(files)
    for rel, data in files.items():
        assert (m.path / rel).read_bytes() == data
    first_gets = m.gets()
    assert first_gets >= len(files) - 1  # the empty object needs no GET
    m.stop()
    assert not is_mounted(m.path)
    m.start()  # same cache dir
    _dirs, seen = tree(m.path)
    assert seen == set(files)
    for rel, data in files.items():
        assert (m.path / rel).read_bytes() == data
    after = m.metrics()
    assert after.get('cachefs_s3_requests_total{op="get"}', 0) == 0
    assert after.get('cachefs_s3_requests_total{op="list"}', 0) <= 1  # the start-up probe
    assert after["cachefs_cache_miss_bytes_total"] == 0
    assert after["cachefs_cache_hit_bytes_total"] == sum(len(d) for d in files.values())


def test_corrupt_cached_block_is_refetched(bucket, mount_factory):
    client, name = bucket
    data = _payload(11, 3 * BLOCK + 5)
    client.put_object(Bucket=name, Key="c.bin", Body=data)
    m = mount_factory(f"s3://{name}", "--block-size", "64K")
    assert (m.path / "c.bin").read_bytes() == data
    m.stop()
    files = [f for f in (m.cache_dir / "objects").rglob("*") if f.is_file()]
    assert len(files) == 1, "the blocks of one object share one file"
    raw = bytearray(files[0].read_bytes())
    assert bytes(raw) == data
    for i in range(4):  # flip a byte in every cached block
        raw[i * BLOCK + 2] ^= 0xFF
    files[0].write_bytes(bytes(raw))
    m.start()
    assert (m.path / "c.bin").read_bytes() == data
    metrics = m.metrics()
    assert metrics["cachefs_cache_corrupt_blocks_total"] == 4
    assert metrics['cachefs_s3_requests_total{op="get"}'] == 4


def test_object_changed_under_open_reader_gives_estale_never_a_mix(bucket, mount_factory):
    client, name = bucket
    old = b"A" * (4 * BLOCK)
    new = b"B" * (4 * BLOCK)
    client.put_object(Bucket=name, Key="v.bin", Body=old)
    m = mount_factory(f"s3://{name}", "--block-size", "64K", "--read-ahead", "64K")
    with open(m.path / "v.bin", "rb", buffering=0) as f:
        first = os.pread(f.fileno(), BLOCK, 0)
        assert first == old[:BLOCK]
        client.put_object(Bucket=name, Key="v.bin", Body=new)
        chunks = [first]
        stale = False
        try:
            for off in range(BLOCK, 4 * BLOCK, BLOCK):
                chunks.append(os.pread(f.fileno(), BLOCK, off))
        except OSError as exc:
            assert exc.errno == errno.ESTALE
            stale = True
        got = b"".join(chunks)
        # Either the old version (blocks prefetched before the change) or ESTALE:
        assert got == old[:len(got)]
    estale_replies = m.metric('cachefs_fuse_errors_total{errno="ESTALE",op="read"}')
    if stale:
        assert estale_replies >= 1
        # ESTALE invalidated the listing: a new open sees the new version at once.
        assert (m.path / "v.bin").read_bytes() == new
    else:
        assert got == old and estale_replies == 0


def test_new_version_visible_after_ttl(bucket, mount_factory):
    client, name = bucket
    client.put_object(Bucket=name, Key="f.txt", Body=b"version one")
    m = mount_factory(f"s3://{name}", "--metadata-ttl", "1s")
    assert (m.path / "f.txt").read_bytes() == b"version one"
    client.put_object(Bucket=name, Key="f.txt", Body=b"version two!")
    import time

    time.sleep(1.5)
    # Expired: the first access is answered from the old listing at once while the
    # listing is refreshed in the background (stale-while-revalidate); then the new
    # version shows (the kernel's entry expires too, and the old inode is stale).
    deadline = time.monotonic() + 20
    while (m.path / "f.txt").read_bytes() != b"version two!":
        assert time.monotonic() < deadline, "the new version never became visible"
        time.sleep(0.2)


def test_writes_are_refused_with_erofs(bucket, mount_factory):
    client, name = bucket
    client.put_object(Bucket=name, Key="dir/f.txt", Body=b"x")
    m = mount_factory(f"s3://{name}")
    attempts = [
        lambda: open(m.path / "new.txt", "w"),
        lambda: open(m.path / "dir/f.txt", "r+b"),
        lambda: os.mkdir(m.path / "newdir"),
        lambda: os.unlink(m.path / "dir/f.txt"),
        lambda: os.rename(m.path / "dir/f.txt", m.path / "dir/g.txt"),
        lambda: os.chmod(m.path / "dir/f.txt", 0o777),
        lambda: os.rmdir(m.path / "dir"),
        lambda: os.truncate(m.path / "dir/f.txt", 0),
    ]
    for attempt in attempts:
        with pytest.raises(OSError) as info:
            attempt()
        assert info.value.errno == errno.EROFS
    assert (m.path / "dir/f.txt").read_bytes() == b"x"


def test_missing_names_are_enoent_and_listing_is_cached(bucket, mount_factory):
    client, name = bucket
    for i in range(30):
        client.put_object(Bucket=name, Key=f"d/f{i}", Body=b"%d" % i)
    m = mount_factory(f"s3://{name}")
    with pytest.raises(FileNotFoundError):
        (m.path / "nope").stat()
    assert sorted(os.listdir(m.path / "d")) == sorted(f"f{i}" for i in range(30))
    lists = m.metric('cachefs_s3_requests_total{op="list"}')
    for _ in range(3):
        os.listdir(m.path / "d")
        for i in range(30):
            (m.path / f"d/f{i}").stat()
    assert m.metric('cachefs_s3_requests_total{op="list"}') == lists


def test_big_directory_readdir_pages(bucket, mount_factory):
    client, name = bucket
    names = {f"file-{i:05d}-{'x' * 40}" for i in range(1050)}  # > 1 ListObjects page (1000 keys)
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(16) as pool:
        list(pool.map(lambda n: client.put_object(Bucket=name, Key=f"big/{n}", Body=b""),
                      names))
    m = mount_factory(f"s3://{name}")
    assert set(os.listdir(m.path / "big")) == names


def test_file_checksums_stable_across_many_files(bucket, mount_factory):
    client, name = bucket
    expected = {}
    for i in range(40):
        data = _payload(1000 + i, random.Random(i).randrange(0, 3 * BLOCK))
        client.put_object(Bucket=name, Key=f"many/{i}.bin", Body=data)
        expected[f"{i}.bin"] = hashlib.sha256(data).hexdigest()
    m = mount_factory(f"s3://{name}/many", "--block-size", "64K")
    got = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in m.path.iterdir()}
    assert got == expected


def test_an_unmount_refused_for_open_files_names_who_holds_them(bucket, mount_factory):
    """`cachefs unmount` of a mount with a file open fails (exit 1) with one line that
    names the process holding it and the way out (--lazy), not only fusermount3's
    "Device or resource busy"; once the file is closed it unmounts."""
    from tests.conftest import run_cachefs

    client, name = bucket
    client.put_object(Bucket=name, Key="held.bin", Body=b"x" * 1000)
    m = mount_factory(f"s3://{name}", "--block-size", "64K")
    with open(m.path / "held.bin", "rb") as f:
        assert f.read() == b"x" * 1000
        proc = run_cachefs("unmount", str(m.path))
        assert proc.returncode == 1
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1, proc.stderr
        assert f"pid {os.getpid()} " in lines[0] and "--lazy" in lines[0], lines[0]
        assert is_mounted(m.path)
    assert run_cachefs("unmount", str(m.path)).returncode == 0
    assert not is_mounted(m.path)


def test_an_unmount_refused_for_a_mount_under_it_names_that_mount(bucket, mount_factory,
                                                                  tmp_path):
    """A mount made on a folder of a cachefs mount (a split of the dataset mounted on its
    own) makes the outer one busy. `cachefs unmount` of the outer one said 'files are open
    under it (close them, or --lazy...)', though none were: it now names the mount under
    it, to be unmounted first."""
    from tests.conftest import Mount, run_cachefs

    client, name = bucket
    client.put_object(Bucket=name, Key="outer/split/", Body=b"")  # (an empty folder)
    client.put_object(Bucket=name, Key="inner/f.txt", Body=b"inner")
    outer = mount_factory(f"s3://{name}/outer")
    inner = Mount(f"s3://{name}/inner", outer.path / "split", tmp_path / "cache-inner",
                  outer.endpoint, [])
    inner.start()
    try:
        assert (inner.path / "f.txt").read_bytes() == b"inner"
        proc = run_cachefs("unmount", str(outer.path))
        assert proc.returncode == 1
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1, proc.stderr
        assert f"{inner.path} is mounted under it" in lines[0], lines[0]
        assert "files are open" not in lines[0] and "in use by" not in lines[0], lines[0]
        assert is_mounted(outer.path) and is_mounted(inner.path)
    finally:
        inner.stop()
    assert run_cachefs("unmount", str(outer.path)).returncode == 0
    assert not is_mounted(outer.path)


def test_an_unmount_whose_daemon_does_not_end_says_so(bucket, mount_factory):
    """'cachefs unmount' waits --timeout seconds for the daemon to finish its cache writes
    and exit. A daemon that did not (stopped here with SIGSTOP; a hung one alike) left it
    exiting 0 in silence, so a script went on to mount again and met 'cache directory ...
    is in use by another cachefs daemon'. Now it exits 1 naming the daemon still running."""
    import signal

    from cachefs.control import registry
    from tests.conftest import run_cachefs

    client, name = bucket
    client.put_object(Bucket=name, Key="a.bin", Body=b"a")
    m = mount_factory(f"s3://{name}")
    pid = int(registry.lookup(m.path)["pid"])
    os.kill(pid, signal.SIGSTOP)
    try:
        proc = run_cachefs("unmount", str(m.path), "--timeout", "1")
    finally:
        os.kill(pid, signal.SIGCONT)
    assert not is_mounted(m.path)  # the unmount itself happened
    assert proc.returncode == 1, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("cachefs: error: "), proc.stderr
    assert f"pid {pid}" in lines[0] and "still running" in lines[0], lines[0]


def test_an_unmount_does_not_wait_on_a_process_that_is_not_the_daemon(bucket, mount_factory):
    """The registry names the daemon by pid, and a pid can name another process by the
    time of the unmount: reused, or in another pid namespace (the DaemonSet's init
    container clears a dead mount whose daemon was pid 1 of its container; pid 1 there is
    the init container's own shell). The unmount waited out --timeout on that process
    (and would now call it a daemon still running). A process that is not a cachefs
    daemon is not waited on."""
    import json
    import signal
    import subprocess

    from cachefs.control import registry
    from tests.conftest import run_cachefs

    client, name = bucket
    client.put_object(Bucket=name, Key="a.bin", Body=b"a")
    m = mount_factory(f"s3://{name}")
    daemon = int(registry.lookup(m.path)["pid"])
    other = subprocess.Popen(["sleep", "300"])
    entry = registry.control_socket(m.path).with_suffix(".json")
    os.kill(daemon, signal.SIGSTOP)  # (so that it does not rewrite its entry meanwhile)
    try:
        info = json.loads(entry.read_text())
        info["pid"] = other.pid
        entry.write_text(json.dumps(info))
        proc = run_cachefs("unmount", str(m.path), "--timeout", "120", timeout=60)
    finally:
        os.kill(daemon, signal.SIGCONT)
        other.kill()
        other.wait()
    assert proc.returncode == 0, proc.stderr
    assert not is_mounted(m.path)
