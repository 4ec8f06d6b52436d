"""The layering stays honest: only the mounting module and the daemon import pyfuse3.

cachefs speaks the FUSE protocol itself (cachefs.fuse.abi/server, the handlers in
cachefs.fuse_ops); libfuse (through pyfuse3) only mounts and unmounts
(cachefs.fuse.device). Everything else (S3 clients, caches, the read path, the
file-system semantics, the request server, the control socket and the CLI's non-mount
commands) must import with pyfuse3 unavailable, so it can be tested and reused without
it and so a lower layer never reaches up.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

FUSE_MODULES = ["cachefs.fuse.device", "cachefs.daemon"]


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
    assert "cachefs.fuse.server" in CORE_MODULES and "cachefs.fuse_ops" in CORE_MODULES
    assert _import_without_pyfuse3(CORE_MODULES) == []


def test_the_fuse_layer_does_need_pyfuse3() -> None:
    # The probe really blocks pyfuse3: the adapter modules fail to import under it.
    failed = _import_without_pyfuse3(FUSE_MODULES)
    assert len(failed) == len(FUSE_MODULES), failed


# -- the direction between packages ---------------------------------------------------
# What each part of cachefs may import of cachefs (docs/design.md, "Packages"): the
# dependencies point down, cli -> daemon -> fuse_ops -> fs -> read -> cache -> s3, with
# control beside fs and everything on the base modules. A unit is a sub-package or a
# top-level module. A new unit must be placed here before it can import anything.
BASE = {"errors", "metrics", "config", "background", "failpoints", "__version__"}
ALLOWED: dict[str, set[str]] = {
    "errors": set(),
    "__version__": set(),
    "config": {"errors"},
    "metrics": {"errors", "__version__"},
    "background": {"errors", "metrics"},
    "metricsport": {"errors", "metrics"},  # the page Prometheus scrapes: the daemon serves it
    "failpoints": {"errors"},
    "gcpolicy": set(),  # the process's garbage-collector settings: the daemon applies them
    "descriptors": set(),  # the process's open-file limit and budget: the daemon applies them
    "heap": set(),  # giving the C heap's free memory back: the daemon's maintenance calls it
    "s3": {"errors", "metrics", "failpoints"},
    "cache": {"s3", "background", "errors", "metrics", "failpoints"},
    "read": {"cache", "s3", "background", "errors", "metrics", "failpoints"},
    "fs": {"read", "cache", "errors", "metrics"},
    "control": {"read", "cache", "background", "errors", "metrics"},
    "passthrough": {"read", "cache", "background", "errors", "metrics", "failpoints"},
    "fuse": {"errors", "metrics"},
    "fuse_ops": {"fs", "fuse", "errors", "metrics"},
    "startup": {"control", "config", "errors", "metrics"},
    "torch": {"control", "errors"},
    "daemon": {"s3", "cache", "read", "fs", "control", "passthrough", "fuse", "fuse_ops",
               "startup", "gcpolicy", "descriptors", "heap", "metricsport", *BASE},
    "cli": {"daemon", "s3", "control", "startup", *BASE},
    "__main__": {"cli"},
}
# Narrower rules inside a unit: the control client runs inside DataLoader worker
# processes (cachefs.torch), so it must stay light; the cache sees S3 only as the
# protocol its listings come through.
ALLOWED_MODULES: dict[str, set[str]] = {
    "cachefs.control.client": {"cachefs.control.registry", "cachefs.errors"},
    "cachefs.control.registry": set(),
}
CACHE_MAY_IMPORT_FROM_S3 = {"cachefs.s3.store"}


def _unit(module: str) -> str:
    """The unit of a dotted cachefs module: its sub-package or its top-level module."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__version__"


def _imports(path: Path) -> set[str]:
    """Every cachefs module ``path`` imports (type-checking imports included: a type-level
    cycle is still a cycle for the reader)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("cachefs."))
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module == "cachefs":
                found.update(f"cachefs.{a.name}" for a in node.names)
            elif node.module.startswith("cachefs."):
                # ``from cachefs.pkg import module`` imports that module, not the package
                for a in node.names:
                    sub = f"{node.module}.{a.name}"
                    found.add(sub if _is_module(sub) else node.module)
    return found


def _is_module(name: str) -> bool:
    import cachefs

    base = Path(cachefs.__file__).parent.joinpath(*name.split(".")[1:])
    return base.with_suffix(".py").is_file() or (base / "__init__.py").is_file()


def _modules_with_paths() -> list[tuple[str, Path]]:
    import cachefs

    root = Path(cachefs.__file__).parent
    out = []
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out.append((name, path))
    return out


def test_packages_import_only_downward() -> None:
    modules = _modules_with_paths()
    assert len(modules) > 30
    wrong = []
    for name, path in modules:
        unit = _unit(name)
        if unit not in ALLOWED:
            wrong.append(f"{name}: unit {unit!r} has no place in ALLOWED (add it, with its rule)")
            continue
        for imported in sorted(_imports(path)):
            target = _unit(imported)
            if name in ALLOWED_MODULES:
                if imported not in ALLOWED_MODULES[name]:
                    wrong.append(f"{name} imports {imported}")
                continue
            if target == unit:
                continue
            if target not in ALLOWED[unit]:
                wrong.append(f"{name} imports {imported} ({unit} may not import {target})")
            elif unit == "cache" and target == "s3" and imported not in CACHE_MAY_IMPORT_FROM_S3:
                wrong.append(f"{name} imports {imported} (cache sees S3 only through s3.store)")
    assert wrong == []


def test_the_direction_rule_catches_an_upward_import(tmp_path: Path) -> None:
    # The parser sees the import forms cachefs uses, so the rule above can fail.
    probe = tmp_path / "probe.py"
    probe.write_text("from cachefs.read.fetcher import Fetcher\nimport cachefs.fs\n"
                     "from cachefs import daemon\nfrom cachefs.control import registry\n"
                     "from . import sibling\n")
    assert _imports(probe) == {"cachefs.read.fetcher", "cachefs.fs", "cachefs.daemon",
                               "cachefs.control.registry"}


# Third-party clients stay behind their package: S3 libraries in cachefs.s3, LMDB in the
# one module that owns the environment (so its error mapping and reader rules hold).
CONFINED = {"boto3": "cachefs.s3.", "botocore": "cachefs.s3.", "awscrt": "cachefs.s3.",
            "lmdb": "cachefs.cache.lmdbenv"}


def _third_party(path: Path) -> set[str]:
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module.split(".")[0])
    return found


def test_s3_and_lmdb_libraries_stay_behind_their_package() -> None:
    wrong = [f"{name} imports {lib}" for name, path in _modules_with_paths()
             for lib in sorted(_third_party(path) & CONFINED.keys())
             if not name.startswith(CONFINED[lib])]
    assert wrong == []
