"""``cachefs status`` against a live mount."""

from __future__ import annotations

import json
import time

import pytest

from tests.conftest import run_cachefs

pytestmark = pytest.mark.fuse


def test_status_reports_a_live_mount(bucket, mount_factory, tmp_path):
    client, name = bucket
    client.put_object(Bucket=name, Key="ds/a.bin", Body=b"a" * 300_000)
    m = mount_factory(f"s3://{name}/ds", "--cache-size", "1G")
    assert (m.path / "a.bin").read_bytes() == b"a" * 300_000
    assert (m.path / "a.bin").read_bytes() == b"a" * 300_000
    deadline = time.monotonic() + 10
    while True:  # the daemon publishes its counters every second
        proc = run_cachefs("status", "--json", str(m.path))
        assert proc.returncode == 0, proc.stderr
        st = json.loads(proc.stdout)
        if st["s3_bytes"] >= 300_000 or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert st["mountpoint"] == str(m.path)
    assert st["source"] == f"s3://{name}/ds/"
    assert st["cache_capacity_bytes"] == 1 << 30
    assert st["cache_used_bytes"] == 300_000
    assert st["s3_bytes"] == 300_000
    assert st["read_bytes"] >= 300_000
    assert st["uptime_seconds"] >= 0
    assert 0.0 <= st["hit_ratio"] < 1.0

    table = run_cachefs("status")
    assert table.returncode == 0
    assert str(m.path) in table.stdout and f"s3://{name}/ds/" in table.stdout

    m.stop()
    gone = run_cachefs("status", "--json", str(m.path))
    assert gone.returncode == 1
    assert "not a live cachefs mount" in gone.stderr
