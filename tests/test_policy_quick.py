"""The cache-policy benchmark in quick mode, so it cannot rot (no wall-clock assertions)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import fuse_unusable_reason

pytestmark = [pytest.mark.fuse, pytest.mark.drops_caches,
              pytest.mark.skipif(fuse_unusable_reason() is not None,
                                 reason=fuse_unusable_reason() or "")]


def test_policy_quick_keeps_c_and_fetches_each_byte_once(tmp_path: Path) -> None:
    out = tmp_path / "policy.json"
    scratch = tmp_path / "tmp"  # (its temporary directory goes here, and must go away)
    scratch.mkdir()
    proc = subprocess.run([sys.executable, "-m", "benchmarks.policy", "--quick", "--json", str(out)],
                          capture_output=True, text=True, timeout=600,
                          cwd=Path(__file__).resolve().parent.parent,
                          env={**os.environ, "TMPDIR": str(scratch)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert list(scratch.iterdir()) == [], "the benchmark left its temporary directory"
    data = json.loads(out.read_text())
    rows = data["rows"]
    assert [(r["policy"], r["epoch"]) for r in rows] == [
        ("keep", 1), ("keep", 2), ("keep", 3), ("lru", 1), ("lru", 2), ("lru", 3)]
    dataset = rows[0]["bytes"]
    assert all(r["bytes"] == dataset for r in rows)  # every epoch read every byte
    for r in rows:
        if r["epoch"] == 1:
            assert dataset <= r["s3_bytes"] <= 1.02 * dataset  # cold: each byte fetched once
    keep_later = [r["hit_ratio"] for r in rows if r["policy"] == "keep" and r["epoch"] > 1]
    lru_later = [r["hit_ratio"] for r in rows if r["policy"] == "lru" and r["epoch"] > 1]
    assert all(h >= 0.98 * data["c"] for h in keep_later), keep_later
    assert max(lru_later) < min(keep_later)
    assert "keep: mean hit ratio after epoch 1" in proc.stdout
