"""`make dist`: a wheel and an sdist whose version comes from git, installable anywhere."""

from __future__ import annotations

import email
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def git_version() -> str:
    """The version setuptools-scm derives from this checkout right now."""
    proc = subprocess.run([sys.executable, "-m", "setuptools_scm"], cwd=REPO, check=True,
                          capture_output=True, text=True, timeout=60)
    return proc.stdout.strip().splitlines()[-1]


@pytest.mark.slow
# make dist and make image (tests/test_image.py) build in the checkout (cachefs.egg-info):
# under pytest-xdist they run in one worker, one after the other.
@pytest.mark.xdist_group("make-dist")
def test_make_dist_builds_a_wheel_that_installs_and_reports_the_git_version(
        tmp_path: Path) -> None:
    expected = git_version()
    assert ".dev" in expected or expected.count(".") == 2, expected
    out = tmp_path / "dist"
    proc = subprocess.run(["make", "--no-print-directory", "dist", f"DIST_DIR={out}"],
                          cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    # The license is an SPDX string: no deprecation warning on every build or install.
    assert "project.license` as a TOML table is deprecated" not in proc.stdout + proc.stderr
    assert not (REPO / "cachefs.egg-info").exists()

    (wheel,) = out.glob("cachefs-*.whl")
    (sdist,) = out.glob("cachefs-*.tar.gz")
    # A platform wheel: it carries the native request loop (cachefs/fuse/_native.c).
    assert wheel.name.startswith(f"cachefs-{expected}-cp3"), wheel.name
    assert sdist.name == f"cachefs-{expected}.tar.gz"
    with zipfile.ZipFile(wheel) as zf:
        meta = email.message_from_bytes(zf.read(f"cachefs-{expected}.dist-info/METADATA"))
        names = zf.namelist()
    assert meta["Version"] == expected
    assert meta["License-Expression"] == "Apache-2.0"
    assert "cachefs/cli.py" in names or "cachefs/cli/__init__.py" in names
    assert not any(n.startswith(("tests/", "benchmarks/")) for n in names)
    assert any(n.startswith("cachefs/fuse/_native") and n.endswith(".so") for n in names), \
        "the wheel was built without the native request loop"
    assert any(n.startswith("cachefs/s3/_wire") and n.endswith(".so") for n in names), \
        "the wheel was built without the GET exchange in C (libcrypto's headers missing?)"
    with tarfile.open(sdist) as tf:  # a pip install from source builds it (or goes without)
        assert f"cachefs-{expected}/cachefs/fuse/_native.c" in tf.getnames()

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    proc = subprocess.run([str(venv / "bin/pip"), "install", "-q", "--disable-pip-version-check",
                           str(wheel)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    proc = subprocess.run([str(venv / "bin/cachefs"), "--version"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=60)
    assert (proc.returncode, proc.stdout.strip()) == (0, f"cachefs {expected}"), proc.stderr
    assert (venv / "bin/mount.cachefs").exists()


def test_version_has_a_fallback_when_not_installed() -> None:
    # Imported from a source tree by an interpreter that has no cachefs installed.
    code = f"import sys; sys.path.insert(0, {str(REPO)!r}); import cachefs; print(cachefs.__version__)"
    proc = subprocess.run(["/usr/bin/python3", "-I", "-c", code], capture_output=True,
                          text=True, timeout=60, cwd="/")
    assert (proc.returncode, proc.stdout.strip()) == (0, "0.0.0+unknown"), proc.stderr


def test_installed_version_comes_from_package_metadata() -> None:
    from importlib.metadata import version

    import cachefs

    assert cachefs.__version__ == version("cachefs")
    assert cachefs.__version__ != "0.0.0+unknown"
