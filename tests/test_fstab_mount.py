"""fstab for real: mount(8) with an fstab line of type cachefs runs the mount.cachefs helper."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import is_mounted, requires_fuse, run_cachefs

pytestmark = [requires_fuse, pytest.mark.fuse]

HELPER_LINK = Path("/sbin/mount.cachefs")


@pytest.fixture
def helper_installed():
    if os.geteuid() != 0:
        pytest.skip("installing /sbin/mount.cachefs needs root")
    if shutil.which("mount") is None:
        pytest.skip("mount(8) is not installed")
    helper = Path(sys.executable).parent / "mount.cachefs"
    if not helper.exists():
        pytest.skip("the mount.cachefs console script is not installed (pip install -e .)")
    created = False
    if not HELPER_LINK.exists():
        HELPER_LINK.symlink_to(helper)
        created = True
    yield
    if created:
        HELPER_LINK.unlink()


def test_fstab_line_mounts_with_mount_a(helper_installed, bucket, s3_endpoint, tmp_path):
    client, name = bucket
    client.put_object(Bucket=name, Key="data/x/hello.txt", Body=b"hello from fstab\n")
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    cache = tmp_path / "cache"
    fstab = tmp_path / "fstab"
    fstab.write_text(
        f"s3://{name}/data {mnt} cachefs "
        f"_netdev,nofail,cache_dir={cache},cache_size=1G,endpoint_url={s3_endpoint},"
        f"metadata_ttl=1h,x-systemd.automount 0 0\n")
    proc = subprocess.run(["mount", "-T", str(fstab), "-a", "-t", "cachefs"],
                          capture_output=True, text=True, timeout=120)
    try:
        assert proc.returncode == 0, proc.stderr
        assert is_mounted(mnt)
        assert (mnt / "x" / "hello.txt").read_bytes() == b"hello from fstab\n"
        with open("/proc/self/mountinfo") as f:
            line = next(ln for ln in f if ln.split()[4] == str(mnt))
        assert "fuse.cachefs" in line and f"s3://{name}/data/" in line
    finally:
        run_cachefs("unmount", str(mnt))
        if is_mounted(mnt):
            subprocess.run(["fusermount3", "-u", "-z", str(mnt)], check=False)
    assert not is_mounted(mnt)


def test_fstab_mount_recovers_after_the_daemon_is_killed(helper_installed, bucket, s3_endpoint,
                                                         tmp_path):
    import json
    import signal
    import time

    client, name = bucket
    client.put_object(Bucket=name, Key="data/x/hello.txt", Body=b"hello again\n")
    mnt, cache = tmp_path / "mnt", tmp_path / "cache"
    mnt.mkdir()
    fstab = tmp_path / "fstab"
    fstab.write_text(f"s3://{name}/data {mnt} cachefs _netdev,cache_dir={cache},"
                     f"endpoint_url={s3_endpoint} 0 0\n")
    try:
        for attempt in range(2):
            proc = subprocess.run(["mount", "-T", str(fstab), str(mnt)], capture_output=True,
                                  text=True, timeout=120)
            assert proc.returncode == 0, proc.stderr
            assert (mnt / "x" / "hello.txt").read_bytes() == b"hello again\n"
            if attempt == 0:
                status = run_cachefs("status", "--json", str(mnt))
                pid = json.loads(status.stdout)["pid"]
                os.kill(pid, signal.SIGKILL)
                while os.path.exists(f"/proc/{pid}"):
                    time.sleep(0.02)
                assert is_mounted(mnt)
        assert "held a dead cachefs mount" in (cache / "cachefs.log").read_text()
    finally:
        run_cachefs("unmount", str(mnt))
        if is_mounted(mnt):
            subprocess.run(["fusermount3", "-u", "-z", str(mnt)], check=False)
    assert not is_mounted(mnt)
