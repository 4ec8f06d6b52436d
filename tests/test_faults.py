"""S3 faults under a real mount: transient failures are retried, the rest become errno."""

from __future__ import annotations

import errno
import os
import random

import pytest

from tests.conftest import Mount
from tests.faultproxy import FaultProxy

pytestmark = pytest.mark.fuse


@pytest.fixture
def proxied(bucket, s3_endpoint, mount_factory, tmp_path):
    client, name = bucket
    data = {f"d/f{i}.bin": random.Random(i).randbytes(50_000 + i * 40_000) for i in range(12)}
    for k, v in data.items():
        client.put_object(Bucket=name, Key=k, Body=v)
    with FaultProxy(s3_endpoint) as proxy:
        m: Mount = mount_factory(f"s3://{name}", "--block-size", "64K", start=False)
        m.endpoint = proxy.url
        m.start()
        yield proxy, m, data


def test_slowdown_and_resets_are_retried(proxied):
    proxy, m, data = proxied
    # Every third GET is throttled and every fifth reset: reads must still be exact.
    proxy.plan = lambda method, path, n: ("503" if n % 3 == 0 else "reset" if n % 5 == 0
                                          else "pass")
    for key, expected in data.items():
        assert (m.path / key).read_bytes() == expected
    metrics = m.metrics()
    assert sum(v for k, v in metrics.items() if k.startswith("cachefs_s3_retries_total")) > 0
    assert sum(v for k, v in metrics.items() if k.startswith("cachefs_s3_throttles_total")) > 0
    assert proxy.faults["503"] > 0 and proxy.faults["reset"] > 0


def test_unreachable_store_becomes_eio_not_a_hang(proxied):
    proxy, m, data = proxied
    os.listdir(m.path / "d")  # metadata cached; data not yet
    proxy.plan = lambda method, path, n: "down"
    with pytest.raises(OSError) as info:
        (m.path / "d/f3.bin").read_bytes()
    assert info.value.errno == errno.EIO
    assert "failed" in m.log()
    # The mount survives: once S3 answers again, the same file reads correctly.
    proxy.plan = lambda method, path, n: "pass"
    assert (m.path / "d/f3.bin").read_bytes() == data["d/f3.bin"]


def test_cached_data_is_served_while_s3_is_down(proxied):
    proxy, m, data = proxied
    for key, expected in data.items():
        assert (m.path / key).read_bytes() == expected
    proxy.plan = lambda method, path, n: "down"
    gets_before = proxy.counts["GET"]
    for key, expected in data.items():
        assert (m.path / key).read_bytes() == expected
    assert proxy.counts["GET"] == gets_before




def test_credentials_never_reach_the_log(bucket, mount_factory):
    from tests.conftest import ACCESS_KEY, SECRET_KEY

    client, name = bucket
    client.put_object(Bucket=name, Key="k.bin", Body=b"k" * 1000)
    m = mount_factory(f"s3://{name}", "--log-level", "debug")
    assert (m.path / "k.bin").read_bytes() == b"k" * 1000
    log = m.log()
    assert "mounted" in log
    assert SECRET_KEY not in log and ACCESS_KEY not in log


def test_full_cache_disk_still_serves_correct_bytes(bucket, mount_factory, tmp_path):
    import subprocess

    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root")
    client, name = bucket
    data = random.Random(5).randbytes(3 << 20)
    client.put_object(Bucket=name, Key="big.bin", Body=data)
    small = tmp_path / "smallfs"
    small.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(small)], check=True)
    try:
        m = mount_factory(f"s3://{name}", "--block-size", "64K", "--cache-size", "3M",
                          cache_dir=small / "cache")
        (small / "filler").write_bytes(b"\0" * (3 << 20))  # leave well under one MiB free
        assert (m.path / "big.bin").read_bytes() == data
        assert (m.path / "big.bin").read_bytes() == data
        assert m.metric("cachefs_cache_write_errors_total") > 0
        assert "No space left on device" in m.log()
        m.stop()
    finally:
        subprocess.run(["umount", "-l", str(small)], check=False)


def test_mount_refuses_a_cache_dir_on_a_full_disk(bucket, tmp_path, s3_endpoint):
    import subprocess

    from tests.conftest import is_mounted, run_cachefs

    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root")
    _, name = bucket
    small = tmp_path / "fullfs"
    small.mkdir()
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(small)], check=True)
    try:
        (small / "cache").mkdir()
        try:
            (small / "filler").write_bytes(b"\0" * (2 << 20))
        except OSError:
            pass  # the disk is now full
        proc = run_cachefs("mount", f"s3://{name}", str(mnt), "--cache-dir", str(small / "cache"),
                           "--cache-size", "512K", "--block-size", "64K", "--endpoint-url", s3_endpoint)
        assert proc.returncode != 0
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and "No space left on device" in lines[0], proc.stderr
        assert not is_mounted(mnt)
    finally:
        subprocess.run(["umount", "-l", str(small)], check=False)
