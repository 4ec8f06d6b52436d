"""The layering stays honest: only the FUSE adapter, passthrough and the daemon import pyfuse3.

The core (S3 clients, caches, the read path, the file-system semantics, the control
socket and the CLI's non-mount commands) must import with pyfuse3 unavailable, so it
can be tested and reused without FUSE and so a lower layer never reaches up.
"""

from __future__ import annotations

import subprocess
import sys

FUSE_MODULES = ["cachefs.fuse_ops", "cachefs.passthrough", "cachefs.daemon"]


def _all_modules() -> list[str]:
    import pkgutil

    import cachefs

    return sorted(m.name for m in pkgutil.walk_packages(cachefs.__path__, "cachefs."))


# Everything but the adapter layer: found by walking the package, so a new module is
# held to the rule without being listed here.
CORE_MODULES = [m for m in _all_modules() if m not in FUSE_MODULES and m != "cachefs.__main__"]

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
    assert len(CORE_MODULES) > 30
    assert "cachefs.cache.blocks" in CORE_MODULES and "cachefs.fs" in CORE_MODULES
    assert _import_without_pyfuse3(CORE_MODULES) == []


def test_the_fuse_layer_does_need_pyfuse3() -> None:
    # The probe really blocks pyfuse3: the adapter modules fail to import under it.
    failed = _import_without_pyfuse3(FUSE_MODULES)
    assert len(failed) == len(FUSE_MODULES), failed
