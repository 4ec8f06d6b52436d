"""The daemon's garbage-collector settings (cachefs.gcpolicy): applied once the mount is
up, and the collector's pauses visible on /metrics."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def test_settle_after_startup_freezes_what_startup_made_and_spaces_young_collections() -> None:
    # In a child interpreter: the settings are process-wide, and pytest's own are left alone.
    code = ("import gc; from cachefs import gcpolicy, metrics; "
            "before = gc.get_freeze_count(); gcpolicy.settle_after_startup(); "
            "print(before, gc.get_freeze_count(), *gc.get_threshold(), gc.isenabled())")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                         timeout=60, check=True).stdout.split()
    before, frozen, young, middle, old, enabled = out
    assert int(before) == 0 and int(frozen) > 10_000  # the modules and their state
    from cachefs import gcpolicy
    assert (int(young), int(middle), int(old)) == (
        gcpolicy.YOUNG_THRESHOLD, gcpolicy.OLDER_THRESHOLD, gcpolicy.OLDER_THRESHOLD)
    assert enabled == "True"  # cycles are still freed


@pytest.mark.fuse
def test_a_mount_collects_rarely_while_it_serves(bucket, mount_factory) -> None:  # type: ignore[no-untyped-def]
    """Reads through a live mount: the collector's counts are on /metrics, and the young
    generation is collected about once per hundred requests, not every few (CPython's
    default threshold of 700 allocations ran ~0.1 young collections per small file
    read cold, each holding the interpreter lock)."""
    client, name = bucket
    files = {f"d/{i:03d}.bin": bytes([i]) * 20_000 for i in range(200)}
    for key, body in files.items():
        client.put_object(Bucket=name, Key=key, Body=body)
    m = mount_factory(f"s3://{name}")
    young = 'python_gc_collections_total{generation="0"}'
    before = m.metric(young)
    for key, body in files.items():
        assert (m.path / key).read_bytes() == body
    collections = m.metric(young) - before
    assert collections < len(files) / 40, collections
