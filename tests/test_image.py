"""`make image`: the DaemonSet's image builds without a registry and runs cachefs.

The image is built as operators build it (`make image`: make dist, a Debian
bookworm base from debootstrap, buildah), then run with `buildah run` and chroot
isolation on the host's network. Full container runtimes cannot start a container
on these machines (crun refuses cgroups in hybrid mode, and setting the
container's rlimits needs CAP_SYS_RESOURCE, which root here lacks), so the image
runs without cgroups or a network namespace; its root file system, users, /dev/fuse
and CAP_SYS_ADMIN are as in the DaemonSet's privileged container.

Inside, the DaemonSet's own commands run in order against a loopback S3 server
(moto) on the host: the init container's, the daemon's (`cachefs mount --config
... --foreground` with the ConfigMap's TOML, pointed at the test bucket), the
readiness probe, reads through the mount (a second open goes through FUSE
passthrough, with the image's stock pyfuse3 and Debian's libfuse, which only
mount), and the preStop unmount, after which the daemon must exit 0.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.conftest import ACCESS_KEY, SECRET_KEY, free_port, fuse_unusable_reason

# (xdist_group: make image runs make dist, which tests/test_dist.py runs too)
pytestmark = [pytest.mark.slow, pytest.mark.fuse, pytest.mark.timeout(1200),
              pytest.mark.xdist_group("make-dist")]

REPO = Path(__file__).resolve().parent.parent
K8S = REPO / "deploy" / "kubernetes"
IMAGE = "localhost/cachefs-test"


def buildah(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["buildah", *args], capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str]]:
    """(image reference, version) of an image made by `make image`."""
    for tool in ("buildah", "debootstrap"):
        if shutil.which(tool) is None:
            pytest.skip(f"{tool} not installed (Debian package: {tool}; make deps installs it)")
    if os.geteuid() != 0:
        pytest.skip("building the image needs root (debootstrap, buildah storage)")
    version = subprocess.run([sys.executable, "-m", "setuptools_scm"], cwd=REPO, check=True,
                             capture_output=True, text=True, timeout=60).stdout.split()[-1]
    ref = f"{IMAGE}:{version.replace('+', '-')}"
    dist = tmp_path_factory.mktemp("dist")
    proc = subprocess.run(["make", "--no-print-directory", "image", f"DIST_DIR={dist}",
                           f"IMAGE={IMAGE}"], cwd=REPO, capture_output=True, text=True,
                          timeout=1100)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    print(proc.stdout.strip().splitlines()[-1])  # "built in N s, SIZE" (pytest -s shows it)
    try:
        yield ref, version
    finally:
        buildah("rmi", ref)


@pytest.fixture
def container(built: tuple[str, str], tmp_path: Path) -> Iterator[Any]:
    """Run commands in a fresh container of the image; yields run(cmd, *mounts, user=)."""
    ref, _ = built
    proc = buildah("from", "--device", "/dev/fuse", "--cap-add", "CAP_SYS_ADMIN", ref)
    assert proc.returncode == 0, proc.stderr
    name = proc.stdout.strip().splitlines()[-1]

    def run(cmd: list[str], *mounts: str, user: str | None = None,
            timeout: float = 180) -> subprocess.CompletedProcess[str]:
        args = ["run", "--isolation", "chroot", "--network", "host"]
        if user:
            args += ["--user", user]
        for m in mounts:
            args += ["--mount", m]
        return buildah(*args, name, "--", *cmd, timeout=timeout)

    try:
        yield run
    finally:
        buildah("rm", name)


def test_image_runs_cachefs_as_an_unprivileged_user(
        built: tuple[str, str], container: Any) -> None:
    ref, version = built
    proc = container(["cachefs", "--version"])
    assert (proc.returncode, proc.stdout.strip()) == (0, f"cachefs {version}"), proc.stderr
    proc = container(["sh", "-c", "id -un; command -v fusermount3; command -v mount.cachefs; "
                      "command -v gcc || echo no-compiler; "
                      "/opt/cachefs/venv/bin/python -c 'import pyfuse3, cachefs.daemon; "
                      "print(pyfuse3.__version__); print(pyfuse3.__file__)'"])
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[:4] == [
        "cachefs", "/usr/bin/fusermount3", "/usr/local/bin/mount.cachefs", "no-compiler"]
    # pyfuse3 is a release from PyPI (no local build label) linked against Debian's
    # libfuse3 (3.14 in bookworm, which has no passthrough of its own): the daemon
    # imports with it, and the next test still passes a file through.
    pyfuse3_version, pyfuse3_so = lines[4:6]
    assert re.fullmatch(r"\d+(\.\d+)+", pyfuse3_version), pyfuse3_version
    proc = container(["ldd", pyfuse3_so])
    assert proc.returncode == 0, proc.stderr
    (libfuse,) = [line.split()[2] for line in proc.stdout.splitlines() if "libfuse3" in line]
    assert libfuse.startswith(("/lib/", "/usr/lib/")), proc.stdout
    labels = json.loads(buildah("inspect", "--type", "image", ref).stdout)["OCIv1"]["config"]["Labels"]
    assert labels["org.opencontainers.image.version"] == version


INSIDE = r'''
import hashlib, json, os, subprocess, sys, time, urllib.request
spec = json.load(open("/test/spec.json"))
os.environ.update(spec["env"])
out = {}
def sh(cmd, timeout=60):
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    return p.returncode, p.stdout + p.stderr
out["init"] = sh(spec["init"])
daemon = subprocess.Popen(spec["daemon"], stdout=open("/tmp/daemon.log", "w"), stderr=subprocess.STDOUT)
deadline = time.monotonic() + 60
while sh(spec["readiness"])[0] != 0 and daemon.poll() is None and time.monotonic() < deadline:
    time.sleep(0.2)
out["ready"] = sh(spec["readiness"])
def metric(name):
    text = urllib.request.urlopen(spec["metrics_url"], timeout=10).read().decode()
    return sum(float(l.split()[-1]) for l in text.splitlines() if l.startswith(name))
try:
    path = os.path.join(spec["mountpoint"], spec["file"])
    out["sha_cold"] = hashlib.sha256(open(path, "rb").read()).hexdigest()
    for _ in range(100):  # the next open of a fully cached file goes through passthrough
        with open(path, "rb") as f:
            f.read(1)
        if metric("cachefs_passthrough_opens_total") > 0:
            break
        time.sleep(0.1)
    out["sha_warm"] = hashlib.sha256(open(path, "rb").read()).hexdigest()
    out["passthrough_opens"] = metric("cachefs_passthrough_opens_total")
    out["s3_errors"] = metric("cachefs_s3_errors_total")
finally:
    # The unmount waits for the daemon to go; this process is its parent (in the pod,
    # the runtime is) and must reap it meanwhile, or it lingers as a zombie.
    prestop = subprocess.Popen(spec["prestop"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True)
    deadline = time.monotonic() + 60
    while prestop.poll() is None and time.monotonic() < deadline:
        daemon.poll()
        time.sleep(0.1)
    if prestop.poll() is None:
        prestop.kill()
    out["prestop"] = (prestop.wait(), prestop.stdout.read())
    try:
        out["daemon_rc"] = daemon.wait(60)
    except subprocess.TimeoutExpired:
        daemon.kill()
        out["daemon_rc"] = "killed"
    out["log"] = open("/tmp/daemon.log").read()[-3000:]
    print(json.dumps(out))
'''


def daemonset_containers() -> tuple[dict[str, Any], dict[str, Any]]:
    spec = yaml.safe_load((K8S / "daemonset.yaml").read_text())["spec"]["template"]["spec"]
    (init,) = spec["initContainers"]
    (main,) = spec["containers"]
    return init, main


def test_daemonset_commands_mount_and_read_inside_the_image(
        bucket: tuple[Any, str], s3_endpoint: str, container: Any, tmp_path: Path) -> None:
    reason = fuse_unusable_reason()
    if reason:
        pytest.skip(reason)
    client, name = bucket
    data = os.urandom(3 * 1024 * 1024 + 12345)
    client.put_object(Bucket=name, Key="train/shard-0.bin", Body=data)

    init, main = daemonset_containers()
    mounts = {m["name"]: m["mountPath"] for m in main["volumeMounts"]}
    configmap = yaml.safe_load((K8S / "configmap.yaml").read_text())
    config = tomllib.loads(configmap["data"]["cachefs.toml"])
    # The ConfigMap's paths are the DaemonSet's volumes; only the bucket, endpoint,
    # size and metrics address change for the test.
    assert config["cache_dir"] == mounts["cache"]
    assert Path(config["mountpoint"]).parent == Path(mounts["host-mounts"])
    metrics_port = free_port()
    config.update(source=f"s3://{name}/train", endpoint_url=s3_endpoint, cache_size="1G",
                  metrics_addr=f"127.0.0.1:{metrics_port}")
    etc, cache, test = tmp_path / "etc", tmp_path / "cache", tmp_path / "test"
    for d in (etc, cache, test):
        d.mkdir()
    (etc / "cachefs.toml").write_text(
        "".join(f"{k} = {json.dumps(v)}\n" for k, v in config.items()))
    (test / "inside.py").write_text(INSIDE)
    (test / "spec.json").write_text(json.dumps({
        "env": {"AWS_ACCESS_KEY_ID": ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
                "AWS_EC2_METADATA_DISABLED": "true"},
        "init": init["command"], "daemon": main["command"],
        "readiness": main["readinessProbe"]["exec"]["command"],
        "prestop": main["lifecycle"]["preStop"]["exec"]["command"],
        "mountpoint": config["mountpoint"], "file": "shard-0.bin",
        "metrics_url": f"http://127.0.0.1:{metrics_port}/metrics"}))

    assert main["securityContext"]["runAsUser"] == 0
    proc = container(
        ["/opt/cachefs/venv/bin/python", "/test/inside.py"],
        f"type=bind,src={etc},dst={mounts['config']},ro",
        f"type=bind,src={cache},dst={mounts['cache']},rw",
        f"type=bind,src={test},dst=/test,ro", user="0:0")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    log = out["log"]
    assert out["init"][0] == 0, out["init"]
    assert out["ready"][0] == 0, (out["ready"], log)
    assert out["sha_cold"] == out["sha_warm"] == hashlib.sha256(data).hexdigest()
    assert out["passthrough_opens"] > 0, log
    assert out["s3_errors"] == 0
    assert out["prestop"][0] == 0, out["prestop"]
    assert out["daemon_rc"] == 0, log
