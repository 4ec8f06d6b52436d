"""The layering stays honest: only the FUSE adapter, passthrough and the daemon import pyfuse3.

The core (S3 clients, caches, the read path, the file-system semantics, the control
socket and the CLI's non-mount commands) must import with pyfuse3 unavailable, so it
can be tested and reused without FUSE and so a lower layer never reaches up.
"""

from __future__ import annotations

import subprocess
import sys

CORE_MODULES = [
    "cachefs.errors", "cachefs.config", "cachefs.metrics",
    "cachefs.s3.store", "cachefs.s3.errors", "cachefs.s3.boto", "cachefs.s3.ranges",
    "cachefs.s3.retry", "cachefs.s3.memory",
    "cachefs.cache.lmdbenv", "cachefs.cache.blocks", "cachefs.cache.metadata",
    "cachefs.read.fetcher", "cachefs.read.budget", "cachefs.read.sequential",
    "cachefs.read.hints", "cachefs.read.lookahead", "cachefs.read.shared", "cachefs.read.breaker",
    "cachefs.read.publishq", "cachefs.s3.objects", "cachefs.s3.express",
    "cachefs.fs",
    "cachefs.control.server", "cachefs.control.client", "cachefs.control.registry",
    "cachefs.control.warm",
    "cachefs.cli.main", "cachefs.cli.status", "cachefs.cli.warm", "cachefs.cli.plan",
    "cachefs.cli.probe", "cachefs.cli.mount_helper", "cachefs.torch",
]

FUSE_MODULES = ["cachefs.fuse_ops", "cachefs.passthrough", "cachefs.daemon"]

_PROBE = """
import importlib, sys
class Blocker:
    def find_spec(self, name, path=None, target=None):
        if name == "pyfuse3" or name.startswith("pyfuse3."):
            raise ImportError("pyfuse3 is blocked by the layering test")
        return None
sys.meta_path.insert(0, Blocker())
failed = []
for name in sys.argv[1:]:
    try:
        importlib.import_module(name)
    except ImportError as exc:
        failed.append(f"{name}: {exc}")
print("\\n".join(failed))
"""


def _import_without_pyfuse3(modules: list[str]) -> list[str]:
    proc = subprocess.run([sys.executable, "-c", _PROBE, *modules], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return [line for line in proc.stdout.splitlines() if line]


def test_core_imports_without_pyfuse3() -> None:
    assert _import_without_pyfuse3(CORE_MODULES) == []


def test_the_fuse_layer_does_need_pyfuse3() -> None:
    # The probe really blocks pyfuse3: the adapter modules fail to import under it.
    failed = _import_without_pyfuse3(FUSE_MODULES)
    assert len(failed) == len(FUSE_MODULES), failed
