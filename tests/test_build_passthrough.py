"""scripts/build-passthrough.sh: its fallback never breaks `make deps` (shellcheck: test_deploy).

The full build (libfuse + patched pyfuse3, a minute or two) is what `make deps` runs; here
only the failure path is exercised, in a throwaway venv-shaped directory.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "scripts" / "build-passthrough.sh"


@pytest.mark.skipif(shutil.which("curl") is None, reason="curl not installed")
def test_unreachable_source_prints_one_line_and_succeeds(tmp_path: Path) -> None:
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").symlink_to(sys.executable)
    env = dict(os.environ, FUSE_TARBALL_URL="http://127.0.0.1:9/fuse.tar.gz")
    proc = subprocess.run(
        ["bash", str(SCRIPT), str(venv)], check=False, capture_output=True, text=True,
        timeout=60, env=env)
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == ""
    assert proc.stdout == (
        "FUSE passthrough unavailable: cannot download http://127.0.0.1:9/fuse.tar.gz; "
        "cachefs will serve reads itself\n")
    assert (venv / ".passthrough").read_text().startswith("unavailable (")
    assert not (venv / "opt" / "libfuse").exists()
