"""``cachefs warm`` and read-order hints against a real mount and a real S3 server."""

from __future__ import annotations

import json
import time

import pytest

from tests.conftest import run_cachefs

pytestmark = pytest.mark.fuse


def _populate(client, name: str) -> dict[str, bytes]:
    files = {}
    for d in range(3):
        for i in range(6):
            files[f"ds/train/c{d}/{i}.bin"] = bytes([d * 16 + i]) * (20_000 + 7_000 * i)
    files["ds/val/v.bin"] = b"v" * 300_000
    for k, v in files.items():
        client.put_object(Bucket=name, Key=k, Body=v)
    return files


def test_warm_directory_then_reads_need_no_get(bucket, mount_factory):
    client, name = bucket
    files = _populate(client, name)
    m = mount_factory(f"s3://{name}/ds", "--block-size", "64K")
    check = run_cachefs("warm", str(m.path), "--check")
    assert check.returncode == 0, check.stderr
    assert "0 B of" in check.stdout and "(0.0%)" in check.stdout

    proc = run_cachefs("warm", str(m.path), "train")
    assert proc.returncode == 0, proc.stderr
    train = {k: v for k, v in files.items() if "/train/" in k}
    assert f"warmed {len(train)} of {len(train)} objects" in proc.stdout
    gets = m.gets()
    assert gets >= len(train)

    # resumable: nothing left to fetch (paths after an option are paths too)
    again = run_cachefs("warm", str(m.path), "--parallel", "4", "train")
    assert again.returncode == 0 and "0 B fetched" in again.stdout, again.stdout + again.stderr
    assert f"of {len(train)} objects" in again.stdout, again.stdout
    assert m.gets() == gets

    for key, data in train.items():
        assert (m.path / key[len("ds/"):]).read_bytes() == data
    assert m.gets() == gets  # every training read came from the cache

    check = run_cachefs("warm", str(m.path), "--check")
    total = sum(len(v) for v in files.values())
    cached = sum(len(v) for v in train.values())
    assert f"({100 * cached / total:.1f}%)" in check.stdout, check.stdout


def test_warm_into_a_cache_too_small_says_what_did_not_stay(bucket, mount_factory):
    """A warm of more than the cache holds said 'warmed 3 of 3 objects, 1.7 MiB resident'
    and exited 0 while the (keep policy) cache had admitted only what fit: the script that
    warmed before training went on, and the training read the rest across regions. It
    counted every block loaded as resident. Now only blocks the cache kept are, an object
    not kept whole is listed as failed with the reason, and warm exits 1; --check agrees."""
    client, name = bucket
    files = {f"big/f{i}.bin": bytes([i]) * 600_000 for i in range(3)}
    for k, v in files.items():
        client.put_object(Bucket=name, Key=k, Body=v)
    m = mount_factory(f"s3://{name}", "--block-size", "64K", "--cache-size", "1M")
    proc = run_cachefs("warm", str(m.path), "big")
    assert proc.returncode == 1, (proc.stdout, proc.stderr)
    assert "warmed 3 of 3" not in proc.stdout, proc.stdout
    assert "not kept: the cache is full" in proc.stderr, proc.stderr
    check = run_cachefs("warm", str(m.path), "--check", "big")
    resident = check.stdout.split(" of ")[0]
    assert f"{resident} resident" in proc.stdout, (proc.stdout, check.stdout)
    for k, v in files.items():  # the reads are right all the same
        assert (m.path / k).read_bytes() == v


def test_warm_manifest_with_missing_entry_fails_clearly(bucket, mount_factory, tmp_path):
    client, name = bucket
    _populate(client, name)
    m = mount_factory(f"s3://{name}/ds")
    manifest = tmp_path / "manifest.txt"
    manifest.write_text("val/v.bin\ntrain/c0/0.bin\nno/such/file.bin\n")
    proc = run_cachefs("warm", str(m.path), "--manifest", str(manifest))
    assert proc.returncode == 1
    assert "failed: no/such/file.bin: no such file or directory" in proc.stderr
    assert "warmed 2 of 2 objects" in proc.stdout
    assert (m.path / "val/v.bin").read_bytes() == b"v" * 300_000


def test_warm_manifest_that_is_not_text_is_one_line(bucket, mount_factory, tmp_path):
    """'cachefs warm --manifest' of a file that is not UTF-8 (a binary given by mistake, a
    Latin-1 list of paths) ended in a UnicodeDecodeError traceback."""
    client, name = bucket
    _populate(client, name)
    m = mount_factory(f"s3://{name}/ds")
    manifest = tmp_path / "manifest.txt"
    manifest.write_bytes("val/v.bin\ntrain/caf\u00e9.bin\n".encode("latin-1"))
    proc = run_cachefs("warm", str(m.path), "--manifest", str(manifest))
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("cachefs: error: "), proc.stderr
    assert "not UTF-8" in lines[0] and str(manifest) in lines[0]


@pytest.mark.parametrize("text", ["", "\n\n", "# nothing to warm today\n"],
                         ids=["empty", "blank-lines", "comment-only"])
def test_warm_manifest_listing_nothing_warms_nothing(bucket, mount_factory, tmp_path, text):
    """A manifest that lists no path (a selection that matched nothing, a file not written
    yet) warmed the whole mount, as if no path had been given: every byte of the dataset
    fetched into the cache. It is now one line and exit 2, and nothing is fetched."""
    client, name = bucket
    _populate(client, name)
    m = mount_factory(f"s3://{name}/ds", "--list-ahead", "0")
    gets = m.gets()
    manifest = tmp_path / "manifest.txt"
    manifest.write_text(text)
    proc = run_cachefs("warm", str(m.path), "--manifest", str(manifest))
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("cachefs: error: "), proc.stderr
    assert "lists no path" in lines[0] and str(manifest) in lines[0]
    assert m.gets() == gets


def test_warm_manifest_lines_are_paths_exactly_as_written(bucket, mount_factory, tmp_path):
    """'cachefs warm --manifest' stripped the whitespace around every line, so a key with
    a leading or trailing space (S3 allows any) could not be warmed through a manifest:
    it was reported missing, or a neighbour without the spaces warmed instead. A line is
    now the path exactly as written, without its line ending (LF or CRLF); only empty
    lines and lines starting with '#' are skipped (a path starting with '#' is written
    './#...')."""
    client, name = bucket
    files = {" lead.bin": b"L" * 70_000, "trail.bin ": b"T" * 80_000, "#hash.bin": b"H" * 5,
             "dir/ both .bin": b"B" * 90_000, "crlf.bin": b"C" * 1000}
    for key, body in files.items():
        client.put_object(Bucket=name, Key=key, Body=body)
    client.put_object(Bucket=name, Key="trail.bin", Body=b"not this one")
    m = mount_factory(f"s3://{name}", "--block-size", "64K", "--list-ahead", "0")
    manifest = tmp_path / "manifest.txt"
    manifest.write_bytes(b"# exact paths\n lead.bin\ntrail.bin \n\n./#hash.bin\n"
                         b"dir/ both .bin\ncrlf.bin\r\n")
    proc = run_cachefs("warm", str(m.path), "--manifest", str(manifest))
    assert proc.returncode == 0, (proc.stdout, proc.stderr)
    assert "warmed 5 of 5 objects" in proc.stdout, proc.stdout
    gets = m.gets()
    for key, body in files.items():
        assert (m.path / key).read_bytes() == body
    assert m.gets() == gets  # (each of them warmed: no GET to read them)


def test_warm_of_an_empty_path_is_refused_not_the_whole_mount(bucket, mount_factory):
    """'cachefs warm /mnt/data "$DIR"' with DIR unset or empty warmed the whole mount (the
    empty path joined to the mount point is the mount point): every byte of the dataset
    fetched. An empty path is one line and exit 2, as an empty path is to ls or cp."""
    client, name = bucket
    _populate(client, name)
    m = mount_factory(f"s3://{name}/ds", "--list-ahead", "0")
    gets = m.gets()
    proc = run_cachefs("warm", str(m.path), "val", "")
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("cachefs: error: ") and "empty" in lines[0]
    assert m.gets() == gets


def test_warm_of_an_empty_directory_warms_nothing_and_succeeds(bucket, mount_factory):
    """A directory the mount shows with nothing in it (a folder marker, a folder whose
    keys cannot be file names) was 'failed: empty: no such file or directory' and exit 1,
    though 'ls' lists it: it is now 0 objects warmed, exit 0. A path that is not there is
    still a failure."""
    client, name = bucket
    client.put_object(Bucket=name, Key="ds/empty/", Body=b"")
    client.put_object(Bucket=name, Key="ds/a.bin", Body=b"a" * 1000)
    m = mount_factory(f"s3://{name}/ds")
    assert (m.path / "empty").is_dir() and list((m.path / "empty").iterdir()) == []
    proc = run_cachefs("warm", str(m.path), "empty")
    assert proc.returncode == 0, (proc.stdout, proc.stderr)
    assert "warmed 0 of 0 objects" in proc.stdout
    missing = run_cachefs("warm", str(m.path), "nosuch")
    assert missing.returncode == 1
    assert "failed: nosuch: no such file or directory" in missing.stderr


def test_warm_rejects_paths_outside_the_mount(bucket, mount_factory, tmp_path):
    client, name = bucket
    _populate(client, name)
    m = mount_factory(f"s3://{name}/ds")
    proc = run_cachefs("warm", str(m.path), str(tmp_path))
    assert proc.returncode != 0
    assert "not inside the cachefs mount" in proc.stderr and "Traceback" not in proc.stderr
    proc = run_cachefs("warm", str(tmp_path))
    assert proc.returncode != 0 and "not inside a cachefs mount" in proc.stderr


def test_warm_of_a_hung_daemon_ends_with_an_error(bucket, mount_factory, monkeypatch):
    """A daemon that stops answering (stopped, wedged) left 'cachefs warm' waiting forever:
    the warm request read its answer with no timeout, though a live daemon reports progress
    every half second. Now a silence of IDLE_TIMEOUT seconds ends it with a one-line error
    (exit 1). The daemon is stopped with SIGSTOP; the bound below only keeps a hang from
    hanging the test."""
    import os
    import signal
    import threading

    from cachefs.cli import warm as warm_cli
    from cachefs.control import registry
    from cachefs.errors import CachefsError

    client, name = bucket
    _populate(client, name)
    m = mount_factory(f"s3://{name}/ds")
    monkeypatch.setattr(warm_cli, "IDLE_TIMEOUT", 1.0, raising=False)
    pid = int(registry.lookup(m.path)["pid"])
    outcome: list[object] = []

    def warm() -> None:
        try:
            outcome.append(warm_cli.warm_main(str(m.path), [], manifest=None, parallel=4,
                                              check=True))
        except CachefsError as exc:
            outcome.append(exc)

    os.kill(pid, signal.SIGSTOP)
    try:
        t = threading.Thread(target=warm, daemon=True)
        t.start()
        t.join(60)
        hung = t.is_alive()
    finally:
        os.kill(pid, signal.SIGCONT)
    t.join(60)
    assert not hung, "cachefs warm waited on the stopped daemon"
    (error,) = outcome
    assert isinstance(error, CachefsError), error
    assert "did not answer" in str(error) and "\n" not in str(error), error
    assert run_cachefs("warm", str(m.path), "--check").returncode == 0  # the daemon goes on


def test_read_order_hint_prefetches_the_hinted_files(bucket, mount_factory):
    from cachefs.control.client import send_hint

    client, name = bucket
    files = _populate(client, name)
    m = mount_factory(f"s3://{name}/ds")
    order = sorted(k for k in files if "/train/" in k)[::-1]
    accepted = send_hint([str(m.path / k[len("ds/"):]) for k in order])
    assert accepted == len(order)
    deadline = time.monotonic() + 20
    while m.gets() < len(order) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert m.gets() == len(order)  # fetched ahead, each exactly once
    for key in order:
        assert (m.path / key[len("ds/"):]).read_bytes() == files[key]
    assert m.gets() == len(order)
    st = json.loads(run_cachefs("status", "--json", str(m.path)).stdout)
    assert st["mountpoint"] == str(m.path)


def test_paths_through_a_symbolic_link_to_the_mount_are_warmed_and_hinted(
        bucket, mount_factory, tmp_path):
    """Clusters often reach a dataset through a link (/data -> the mount, or a folder of
    links to its files). 'cachefs warm LINK' said 'not inside a cachefs mount', and a
    HintedSampler over such paths sent no hint (one warning, then training without
    prefetch): the paths were compared with the mount table as written."""
    from cachefs.control.client import send_hint

    client, name = bucket
    files = _populate(client, name)
    m = mount_factory(f"s3://{name}/ds")
    data = tmp_path / "data"
    data.symlink_to(m.path)
    (tmp_path / "links").mkdir()
    (tmp_path / "links" / "v.bin").symlink_to(m.path / "val" / "v.bin")
    proc = run_cachefs("warm", str(data), "--check")
    assert proc.returncode == 0, proc.stderr
    assert f"{len(files)} objects" in proc.stdout, proc.stdout
    proc = run_cachefs("warm", str(data), str(data / "train" / "c1"))
    assert proc.returncode == 0, proc.stderr
    assert "warmed 6 of 6 objects" in proc.stdout, proc.stdout
    order = [str(data / k[len("ds/"):]) for k in sorted(files) if "/c2/" in k]
    order.append(str(tmp_path / "links" / "v.bin"))
    assert send_hint(order) == len(order)
    deadline = time.monotonic() + 20
    while m.gets() < len(files) - 6 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert m.gets() == 6 + len(order)  # the hinted files were fetched ahead, once each


def test_hinted_sampler_sends_the_epoch_order(bucket, mount_factory):
    import random

    from cachefs.torch import hinted

    client, name = bucket
    files = _populate(client, name)
    m = mount_factory(f"s3://{name}/ds")
    keys = sorted(files)
    paths = [str(m.path / k[len("ds/"):]) for k in keys]

    class Shuffled:
        def __init__(self, n: int) -> None:
            self.n, self.epoch = n, 0

        def __iter__(self):
            order = list(range(self.n))
            random.Random(self.epoch).shuffle(order)
            return iter(order)

        def __len__(self) -> int:
            return self.n

        def set_epoch(self, epoch: int) -> None:
            self.epoch = epoch

    sampler = hinted(Shuffled(len(paths)), paths=paths)
    sampler.set_epoch(3)
    order = list(sampler)
    assert sorted(order) == list(range(len(paths))) and sampler.hints_sent == 1
    deadline = time.monotonic() + 20
    while m.gets() < len(paths) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert m.gets() == len(paths)
    for i in order:
        assert open(paths[i], "rb").read() == files[keys[i]]
    assert m.gets() == len(paths)


def test_a_copied_or_pickled_hinted_sampler_still_hints(bucket, mount_factory):
    """Training frameworks copy and pickle samplers (re-created data loaders, resumable
    loader state). The wrapper forwarded every unknown attribute to its sampler, the
    sampler too before it was set: any copy or unpickling recursed to RecursionError."""
    import copy
    import pickle

    from cachefs.torch import hinted

    client, name = bucket
    files = _populate(client, name)
    m = mount_factory(f"s3://{name}/ds")
    keys = sorted(files)
    paths = [str(m.path / k[len("ds/"):]) for k in keys]
    sampler = hinted(list(range(len(paths)))[::-1], paths=paths)
    for again in (copy.copy(sampler), copy.deepcopy(sampler),
                  pickle.loads(pickle.dumps(sampler))):
        assert list(again) == list(range(len(paths)))[::-1] and again.hints_sent == 1
        assert len(again) == len(paths)
    with pytest.raises(AttributeError):
        sampler.no_such_attribute  # noqa: B018
    deadline = time.monotonic() + 20
    while m.gets() < len(paths) and time.monotonic() < deadline:
        time.sleep(0.1)
    for i, path in enumerate(paths):
        assert open(path, "rb").read() == files[keys[i]]
    assert m.gets() == len(paths)  # hinted ahead, each fetched once


def test_hinted_sampler_outside_cachefs_is_harmless(tmp_path):
    from cachefs.torch import hinted

    sampler = hinted([2, 0, 1], paths=[str(tmp_path / f"{i}") for i in range(3)])
    assert list(sampler) == [2, 0, 1]
    assert sampler.hints_sent == 0 and len(sampler) == 3


@pytest.mark.parametrize("parallel", ["0", "1025", "100000"])
def test_warm_parallel_out_of_range_is_bad_input(bucket, mount_factory, parallel):
    """Bad input exits 2 with one line, as every command's does; the daemon's own limit
    (1024) was only found by the request: exit 1, and a refused request in its log."""
    client, name = bucket
    _populate(client, name)
    m = mount_factory(f"s3://{name}/ds")
    proc = run_cachefs("warm", str(m.path), "train", "--parallel", parallel)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().count("\n") == 0 and "--parallel" in proc.stderr, proc.stderr
    assert "refused a request" not in m.log()
