"""The systemd template unit and the HyperPod lifecycle script.

`systemd-analyze verify` refuses a unit whose ExecStart binary does not exist,
so it checks a copy with every /usr/local/bin/cachefs replaced by /bin/true;
all other settings are verified as written. Unknown keys and bad values are only
warnings (exit status 0), so any output at all counts as a failure.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tomllib
from pathlib import Path

import pytest

from cachefs.config import load_config_file, resolve

REPO = Path(__file__).resolve().parent.parent
UNIT = REPO / "systemd" / "cachefs@.service"
INSTALL_SH = REPO / "deploy" / "hyperpod" / "install_cachefs.sh"
CACHEFS = "/usr/local/bin/cachefs"
CONFIG = "/etc/cachefs/%i.toml"

SYSTEMD_ANALYZE = shutil.which("systemd-analyze")
needs_systemd_analyze = pytest.mark.skipif(
    SYSTEMD_ANALYZE is None, reason="systemd-analyze not installed (Debian package: systemd)")
SHELLCHECK = shutil.which("shellcheck")
needs_shellcheck = pytest.mark.skipif(
    SHELLCHECK is None, reason="shellcheck not installed (Debian package: shellcheck)")


def unit_settings(text: str) -> dict[str, list[str]]:
    """``Section.Key -> [values]`` of a unit file (keys may repeat in systemd units)."""
    settings: dict[str, list[str]] = {}
    section = ""
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("["):
            section = line.strip("[]")
            continue
        key, _, value = line.partition("=")
        settings.setdefault(f"{section}.{key.strip()}", []).append(value.strip())
    return settings


def verify(unit_text: str, tmp_path: Path, name: str = "cachefs@demo.service") -> str:
    """Run `systemd-analyze verify` on an instance of the unit; return its output."""
    unit = tmp_path / name
    unit.write_text(unit_text.replace(CACHEFS, "/bin/true"))
    assert SYSTEMD_ANALYZE is not None
    proc = subprocess.run(
        [SYSTEMD_ANALYZE, "verify", "--man=no", str(unit)],
        check=False, capture_output=True, text=True, timeout=30)
    out = (proc.stdout + proc.stderr).strip()
    if proc.returncode != 0 and not out:
        out = f"exit status {proc.returncode}"
    return out


@needs_systemd_analyze
def test_unit_passes_systemd_analyze_verify(tmp_path: Path) -> None:
    assert verify(UNIT.read_text(), tmp_path) == ""


@needs_systemd_analyze
def test_verify_catches_a_broken_unit(tmp_path: Path) -> None:
    # The check above would be worthless if verify accepted typos silently.
    broken = UNIT.read_text().replace("Restart=on-failure", "Restat=on-failure")
    assert "Unknown key" in verify(broken, tmp_path)


def test_unit_runs_the_configured_instance_under_the_contract() -> None:
    s = unit_settings(UNIT.read_text())
    assert s["Service.Type"] == ["notify"]
    assert s["Service.NotifyAccess"] == ["main"]
    assert s["Service.ExecStart"] == [f"{CACHEFS} mount --config {CONFIG} --foreground"]
    # A dead mount left by a killed daemon is the daemon's to detach (tests/test_crash.py);
    # a lazy unmount before start would also detach a live mount someone else made.
    assert "Service.ExecStartPre" not in s
    assert s["Service.ExecStop"] == [f"{CACHEFS} unmount --config {CONFIG} --quiet"]
    assert s["Service.Restart"] == ["on-failure"]
    assert s["Service.KillMode"] == ["mixed"]
    assert int(s["Service.TimeoutStartSec"][0]) >= 90
    assert int(s["Service.LimitNOFILE"][0]) >= 65536
    assert "network-online.target" in s["Unit.After"][0]
    assert "network-online.target" in s["Unit.Wants"][0]
    assert s["Install.WantedBy"] == ["multi-user.target"]
    # A private mount namespace would hide the FUSE mount from everyone else.
    namespacing = {"PrivateTmp", "ProtectSystem", "ProtectHome", "PrivateMounts",
                   "PrivateDevices", "ReadOnlyPaths", "TemporaryFileSystem"}
    assert not {key.split(".", 1)[1] for key in s} & namespacing


def _stop_command(config: Path) -> list[str]:
    """The unit's ExecStop for an instance whose config is ``config``, run with this
    interpreter's cachefs."""
    import shlex
    import sys

    (line,) = unit_settings(UNIT.read_text())["Service.ExecStop"]
    argv = shlex.split(line.replace(CONFIG, str(config)))
    assert argv[0] == CACHEFS
    return [sys.executable, "-m", "cachefs", *argv[1:]]


@pytest.mark.fuse
def test_the_units_stop_succeeds_whether_or_not_the_mount_is_still_there(
        tmp_path: Path, bucket: tuple[object, str], s3_endpoint: str) -> None:
    """systemd runs ExecStop whenever a unit that started is stopped, also when the daemon
    has ended on its own: unmounted by hand ('cachefs unmount /mnt/data'), or killed and
    its dead mount detached. ExecStop then said '... is not a cachefs mount' and exited
    2, so stopping the unit failed and it was left 'failed'. It unmounts a live mount,
    and succeeds when there is none."""
    from tests.conftest import fuse_unusable_reason, is_mounted, run_cachefs

    reason = fuse_unusable_reason()
    if reason:
        pytest.skip(reason)
    _, name = bucket
    mp = tmp_path / "data"
    mp.mkdir()
    config = tmp_path / "data.toml"
    config.write_text(f'source = "s3://{name}"\nmountpoint = "{mp}"\n'
                      f'cache_dir = "{tmp_path / "cache"}"\nendpoint_url = "{s3_endpoint}"\n')
    try:
        for by_hand in (False, True):
            up = run_cachefs("mount", "--config", str(config))
            assert up.returncode == 0, up.stderr
            if by_hand:
                assert run_cachefs("unmount", str(mp)).returncode == 0
            stop = subprocess.run(_stop_command(config), capture_output=True, text=True,
                                  timeout=120)
            assert stop.returncode == 0, stop.stderr
            assert not is_mounted(mp)
    finally:
        if is_mounted(mp):
            run_cachefs("unmount", "--lazy", str(mp))


def test_install_script_uses_the_repository_unit_and_config_keys() -> None:
    script = INSTALL_SH.read_text()
    assert script.startswith("#!/bin/bash\n")
    assert "set -Eeuo pipefail" in script
    assert "cachefs@.service" in script
    # Every key the script writes into the TOML belongs to the config contract.
    example_keys = set(re.findall(r"^#?\s*([a-z_]+)\s*=", (REPO / "systemd" / "example.toml")
                                  .read_text(), re.MULTILINE))
    written = set(re.findall(r"^([a-z_]+) = ", script, re.MULTILINE))
    assert {"source", "mountpoint", "cache_dir", "cache_size"} <= written
    assert written <= example_keys


def test_install_script_rejects_bad_arguments_in_one_line(tmp_path: Path) -> None:
    for args, message in [
        ([], "install_cachefs.sh: usage: install_cachefs.sh s3://BUCKET/PREFIX MOUNT_POINT"),
        (["bucket/prefix", "/mnt/data"], "install_cachefs.sh: bucket must be an s3:// URL"),
        (["s3://b/p", "mnt/data"], "install_cachefs.sh: mount point must be an absolute path"),
    ]:
        proc = subprocess.run(
            ["bash", str(INSTALL_SH), *args], check=False, capture_output=True, text=True,
            timeout=30, cwd=tmp_path, env={"PATH": "/usr/bin:/bin"})
        assert proc.returncode != 0
        assert proc.stderr.startswith(message), proc.stderr
        assert proc.stderr.count("\n") == 1


@needs_shellcheck
@pytest.mark.parametrize("script", [INSTALL_SH, *sorted((REPO / "scripts").glob("*.sh"))],
                         ids=lambda p: p.stem)
def test_shell_scripts_are_shellcheck_clean(script: Path) -> None:
    assert SHELLCHECK is not None
    proc = subprocess.run(
        [SHELLCHECK, "--severity=style", str(script)],
        check=False, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr


# --- install_cachefs.sh end to end in a staging tree, with system commands stubbed ---

STUBS = {
    # dpkg-query: every package is already installed, so apt-get is never needed; on a
    # bare node (FAKE_BARE_NODE) none is, and apt-get "installs" them.
    "dpkg-query": '[ -z "$FAKE_BARE_NODE" ] || exit 1; printf "install ok installed"',
    "apt-get": 'echo "apt-get $*" >> "$STUB_LOG"; [ -n "$FAKE_BARE_NODE" ]',
    "id": "echo 0",
    "df": """case "$*" in
  *avail*) printf "Avail\\n%s\\n" "$FAKE_AVAIL";;
  *) printf "Mounted on\\n/x\\n";;
esac""",
    "du": 'printf "%s\\t%s\\n" "$FAKE_HELD" "$3"',
    "systemctl": """echo "systemctl $*" >> "$STUB_LOG"
[ -z "$FAKE_SYSTEMCTL_FAIL" ] || exit 1
case $1 in
  is-active) [ -e "$STUB_STATE" ];;
  start|restart) touch "$STUB_STATE";;
esac""",
    "mountpoint": "exit 0",
    # The AWS CLI: `aws s3 cp SRC DEST` "downloads" an empty file.
    "aws": 'echo "aws $*" >> "$STUB_LOG"; touch "${@: -1}"',
    # A pip that "installs" cachefs and mount.cachefs into its own bin directory.
    "fakepip": """echo "pip $*" >> "$STUB_LOG"
[ -z "$FAKE_PIP_FAIL" ] || exit 1
for f in cachefs mount.cachefs; do
  printf "#!/bin/sh\\n" > "$(dirname "$0")/$f"; chmod +x "$(dirname "$0")/$f"
done""",
    # A Python >= 3.11 that makes venvs with that pip.
    "fakepython": r"""case "$1 $2" in
  "-c import sys; sys.exit"*) exit 0;;
  "-c import sys; print"*) echo 3.11;;
  "-m venv") mkdir -p "$3/bin"; cp "$0" "$3/bin/python"
    cp "$(dirname "$0")/fakepip" "$3/bin/pip";;
  *) exit 3;;
esac""",
}

GIB = 1024**3


@pytest.fixture
def staging(tmp_path: Path) -> dict[str, object]:
    stubs = tmp_path / "stubs"
    stubs.mkdir()
    for name, body in STUBS.items():
        (stubs / name).write_text("#!/bin/bash\n" + body + "\n")
        (stubs / name).chmod(0o755)
    root = tmp_path / "root"
    root.mkdir()
    env = {
        "PATH": f"{stubs}:/usr/bin:/bin", "CACHEFS_ROOT": str(root),
        "CACHEFS_PYTHON": str(stubs / "fakepython"), "CACHEFS_PACKAGE": "/wheels/cachefs.whl",
        "STUB_LOG": str(tmp_path / "calls.log"), "STUB_STATE": str(tmp_path / "active"),
        "FAKE_AVAIL": str(100 * GIB), "FAKE_HELD": "0",
    }
    return {"root": root, "env": env, "log": tmp_path / "calls.log"}


def run_install(staging: dict[str, object], *args: str, script: Path = INSTALL_SH,
                **env: str) -> tuple[str, list[str]]:
    log = staging["log"]
    assert isinstance(log, Path)
    log.unlink(missing_ok=True)
    proc = subprocess.run(
        ["bash", str(script), *args], check=False, capture_output=True, text=True,
        timeout=30, env={**staging["env"], **env})  # type: ignore[dict-item]
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == ""
    calls = log.read_text().splitlines() if log.exists() else []
    return proc.stdout, calls


def test_install_writes_config_unit_and_starts_the_service(staging: dict[str, object]) -> None:
    root = staging["root"]
    assert isinstance(root, Path)
    (root / "opt/dlami/nvme").mkdir(parents=True)
    out, calls = run_install(staging, "s3://bucket/imagenet/", "/mnt/data/", "us-west-2")

    config = tomllib.loads((root / "etc/cachefs/data.toml").read_text())
    assert config == {
        "source": "s3://bucket/imagenet/", "mountpoint": "/mnt/data",
        "cache_dir": f"{root}/opt/dlami/nvme/cachefs/data", "cache_size": "80G",
        "cache_policy": "keep", "memory_budget": "1G", "metrics_addr": "127.0.0.1:9477",
        "allow_other": True, "region": "us-west-2"}
    assert (root / "etc/systemd/system/cachefs@.service").read_text() == UNIT.read_text()
    dropin = (root / "etc/systemd/system/cachefs@data.service.d/10-cache-dir.conf").read_text()
    assert f"RequiresMountsFor={root}/opt/dlami/nvme/cachefs\n" in dropin
    assert f"ExecStartPre=/bin/mkdir -p {root}/opt/dlami/nvme/cachefs/data\n" in dropin
    assert os.readlink(root / "usr/local/bin/cachefs") == f"{root}/opt/cachefs/venv/bin/cachefs"
    assert os.readlink(root / "sbin/mount.cachefs") == (
        f"{root}/opt/cachefs/venv/bin/mount.cachefs")
    assert (root / "mnt/data").is_dir()
    assert calls == [
        "pip install --quiet --disable-pip-version-check --upgrade /wheels/cachefs.whl",
        "systemctl daemon-reload", "systemctl enable --quiet cachefs@data.service",
        "systemctl is-active --quiet cachefs@data.service",
        "systemctl start cachefs@data.service"]
    assert out.splitlines()[-1] == (
        "install_cachefs.sh: s3://bucket/imagenet/ mounted at /mnt/data (cachefs@data.service)")


def test_install_is_idempotent_and_restarts_only_on_change(staging: dict[str, object]) -> None:
    root = staging["root"]
    assert isinstance(root, Path)
    run_install(staging, "s3://bucket/p", "/mnt/data")
    config_path = root / "etc/cachefs/data.toml"
    first = config_path.read_text()
    # No NVMe instance store: the cache goes to /opt/sagemaker.
    assert tomllib.loads(first)["cache_dir"] == f"{root}/opt/sagemaker/cachefs/data"

    # Second run on a warm node: the cache now holds 30 GiB, 70 GiB are free; same size.
    out, calls = run_install(staging, "s3://bucket/p", "/mnt/data",
                             FAKE_AVAIL=str(70 * GIB), FAKE_HELD=str(30 * GIB))
    assert config_path.read_text() == first
    assert "wrote" not in out
    assert calls[-1] == "systemctl start cachefs@data.service"

    out, calls = run_install(staging, "s3://bucket/p", "/mnt/data", "eu-west-1",
                             "http://minio:9000", CACHEFS_NAME="train")
    config = tomllib.loads((root / "etc/cachefs/train.toml").read_text())
    assert config["endpoint_url"] == "http://minio:9000"
    assert calls[-1] == "systemctl restart cachefs@train.service"


def test_install_configures_a_shared_cache_tier(staging: dict[str, object]) -> None:
    root = staging["root"]
    assert isinstance(root, Path)
    run_install(staging, "s3://bucket/p", "/mnt/data",
                CACHEFS_SHARED_CACHE="s3://cachefs-cache--use1-az4--x-s3/p",
                CACHEFS_SHARED_CACHE_REGION="us-east-1")
    config = tomllib.loads((root / "etc/cachefs/data.toml").read_text())
    assert config["shared_cache"] == "s3://cachefs-cache--use1-az4--x-s3/p"
    assert config["shared_cache_region"] == "us-east-1"
    assert "shared_cache_endpoint_url" not in config
    proc = subprocess.run(
        ["bash", str(INSTALL_SH), "s3://b/p", "/mnt/data"], check=False, capture_output=True,
        text=True, timeout=30, env={**staging["env"], "CACHEFS_SHARED_CACHE": "cache"})  # type: ignore[dict-item]
    assert proc.returncode == 1
    assert proc.stderr == ("install_cachefs.sh: CACHEFS_SHARED_CACHE must be an s3:// URL, "
                           "got 'cache'\n")


def test_install_refuses_a_disk_without_room(staging: dict[str, object]) -> None:
    proc = subprocess.run(
        ["bash", str(INSTALL_SH), "s3://b/p", "/mnt/data"], check=False, capture_output=True,
        text=True, timeout=30, env={**staging["env"], "FAKE_AVAIL": str(GIB)})  # type: ignore[dict-item]
    assert proc.returncode == 1
    assert proc.stderr == "install_cachefs.sh: less than 1 GiB free for the cache on /x\n"


def test_install_failures_are_one_line(staging: dict[str, object]) -> None:
    env = {**staging["env"], "FAKE_PIP_FAIL": "1"}
    proc = subprocess.run(["bash", str(INSTALL_SH), "s3://b/p", "/mnt/data"], check=False,
                          capture_output=True, text=True, timeout=30, env=env)  # type: ignore[arg-type]
    assert proc.returncode == 1
    assert proc.stderr == "install_cachefs.sh: pip could not install /wheels/cachefs.whl into " \
        f"{staging['root']}/opt/cachefs/venv\n"
    # A failure nobody anticipated still ends in one line naming the command.
    env = {**staging["env"], "FAKE_SYSTEMCTL_FAIL": "1"}
    proc = subprocess.run(["bash", str(INSTALL_SH), "s3://b/p", "/mnt/data"], check=False,
                          capture_output=True, text=True, timeout=30, env=env)  # type: ignore[arg-type]
    assert proc.returncode == 1
    assert re.fullmatch(r"install_cachefs.sh: failed at line \d+: systemctl daemon-reload\n",
                        proc.stderr)


def test_install_from_an_s3_wheel_needs_only_the_wheel_and_the_unit(
        staging: dict[str, object], tmp_path: Path) -> None:
    # The lifecycle scripts' S3 prefix as HyperPod copies it to the node: flat, and with
    # nothing for passthrough (cachefs negotiates it with the kernel itself).
    upload = tmp_path / "upload"
    upload.mkdir()
    for f in (INSTALL_SH, UNIT):
        shutil.copy(f, upload)
    root = staging["root"]
    assert isinstance(root, Path)
    wheel = "cachefs-0.2.0-cp311-cp311-linux_x86_64.whl"
    _, calls = run_install(staging, "s3://bucket/p", "/mnt/data", script=upload / INSTALL_SH.name,
                           CACHEFS_PACKAGE=f"s3://releases/cachefs/{wheel}")
    assert calls == [
        f"aws s3 cp --only-show-errors s3://releases/cachefs/{wheel} {root}/opt/cachefs/dist/{wheel}",
        f"pip install --quiet --disable-pip-version-check --upgrade {root}/opt/cachefs/dist/{wheel}",
        "systemctl daemon-reload", "systemctl enable --quiet cachefs@data.service",
        "systemctl is-active --quiet cachefs@data.service",
        "systemctl start cachefs@data.service"]
    # The daemon reads that config with passthrough on (where the kernel grants it).
    cfg = resolve({}, environ={}, file_values=load_config_file(root / "etc/cachefs/data.toml"))
    assert cfg.passthrough == "auto"

    proc = subprocess.run(
        ["bash", str(INSTALL_SH), "s3://bucket/p", "/mnt/data"], check=False, capture_output=True,
        text=True, timeout=30,
        env={**staging["env"], "CACHEFS_PACKAGE": "s3://releases/cachefs/"})  # type: ignore[dict-item]
    assert (proc.returncode, proc.stderr) == (1, "install_cachefs.sh: CACHEFS_PACKAGE "
                                              "s3://releases/cachefs/: an s3:// package must be a .whl file\n")


def test_install_turns_passthrough_off_in_the_config_when_asked(
        staging: dict[str, object]) -> None:
    root = staging["root"]
    assert isinstance(root, Path)
    run_install(staging, "s3://bucket/p", "/mnt/data", CACHEFS_PASSTHROUGH="off")
    cfg = resolve({}, environ={}, file_values=load_config_file(root / "etc/cachefs/data.toml"))
    assert cfg.passthrough == "off"
    proc = subprocess.run(
        ["bash", str(INSTALL_SH), "s3://b/p", "/mnt/data"], check=False, capture_output=True,
        text=True, timeout=30, env={**staging["env"], "CACHEFS_PASSTHROUGH": "on"})  # type: ignore[dict-item]
    assert (proc.returncode, proc.stderr) == (
        1, "install_cachefs.sh: CACHEFS_PASSTHROUGH must be auto or off, got 'on'\n")


def test_install_on_a_bare_node_installs_what_pip_needs_for_pyfuse3(
        staging: dict[str, object]) -> None:
    # The system's libfuse 3 and a compiler for pyfuse3 (and the interpreter's venv
    # and headers); nothing is downloaded or built for passthrough.
    _, calls = run_install(staging, "s3://bucket/p", "/mnt/data", FAKE_BARE_NODE="1")
    assert calls[:5] == [
        "apt-get update -qq",
        "apt-get install -y -qq fuse3 libfuse3-dev pkg-config gcc libc6-dev",
        "apt-get update -qq",
        "apt-get install -y -qq python3.11-venv python3.11-dev",
        "pip install --quiet --disable-pip-version-check --upgrade /wheels/cachefs.whl"]
