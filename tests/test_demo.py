"""The README's main job, `make demo` (benchmarks.demo), on a small dataset: it reads the
dataset cold then warm through a real mount, and leaves neither a mount nor its files."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.fuse
@pytest.mark.drops_caches
def test_demo_reads_cold_then_warm_and_leaves_nothing_behind(tmp_path: Path) -> None:
    env = dict(os.environ, TMPDIR=str(tmp_path))  # (where its temporary directory goes)
    proc = subprocess.run([sys.executable, "-m", "benchmarks.demo", "--files", "20",
                           "--shards", "1", "--shard-mb", "2", "--workers", "2"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    lines = {line.split()[0]: line.split() for line in proc.stdout.splitlines() if line.strip()}
    assert lines["warm"][-3:] == ["0.0", "MB", "100.0%"], proc.stdout  # nothing from S3 warm
    assert "warm/cold speed-up" in proc.stdout
    # The dataset was on disk twice (the S3 server's copy and the cache): both are gone.
    assert list(tmp_path.iterdir()) == [], list(tmp_path.iterdir())
    with open("/proc/self/mounts") as f:
        assert str(tmp_path) not in f.read()
