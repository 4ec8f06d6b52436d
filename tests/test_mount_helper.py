"""mount.cachefs: fstab option translation and the mount(8) helper calling convention.

The argument shapes below are the ones mount(8) (util-linux 2.38) and mount.fuse3
(libfuse 3.14) were observed to pass to a helper. Real fstab mounts are tested
with the daemon elsewhere.
"""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from cachefs.cli import mount_helper
from cachefs.cli.mount_helper import fstab_options_to_argv, main
from cachefs.errors import ConfigError

REPO = Path(__file__).resolve().parent.parent

#: The config contract: every `cachefs mount` option and its TOML key.
CONTRACT_VALUE_KEYS = {
    "cache_dir", "cache_size", "endpoint_url", "region", "metrics_addr", "metadata_ttl",
    "cache_policy", "uid", "gid", "file_mode", "dir_mode", "log_level", "memory_budget",
    "block_size", "list_ahead", "manifest", "retry_deadline", "shared_cache",
    "shared_cache_endpoint_url", "shared_cache_region", "shared_cache_profile",
    "shared_cache_timeout",
}
CONTRACT_FLAG_KEYS = {"allow_other"}


def test_documented_fstab_line_translates() -> None:
    argv = fstab_options_to_argv(
        "s3://bucket/prefix", "/mnt/data",
        "_netdev,cache_dir=/var/cache/cachefs,cache_size=20G,allow_other")
    assert argv == [
        "mount", "s3://bucket/prefix", "/mnt/data",
        "--cache-dir", "/var/cache/cachefs", "--cache-size", "20G", "--allow-other",
    ]


def test_shared_cache_fstab_line_translates() -> None:
    argv = fstab_options_to_argv(
        "s3://bucket/prefix", "/mnt/data",
        "_netdev,cache_dir=/c,shared_cache=s3://cache--use1-az4--x-s3/ds,"
        "shared_cache_region=us-east-1")
    assert argv == [
        "mount", "s3://bucket/prefix", "/mnt/data", "--cache-dir", "/c",
        "--shared-cache", "s3://cache--use1-az4--x-s3/ds", "--shared-cache-region", "us-east-1",
    ]


def test_options_added_by_mount_and_mount_fuse3_are_dropped() -> None:
    # mount(8) adds rw (and noexec,nosuid,nodev for `user`); mount.fuse3 adds dev,suid;
    # systemd's fstab generator consumes x-systemd.* and comment=systemd.*.
    options = ("rw,noatime,noexec,nosuid,nodev,region=eu-west-1,_netdev,nofail,user,"
               "x-systemd.automount,x-systemd.requires=network-online.target,"
               "comment=systemd.automount,defaults,noauto,dev,suid,relatime,ro,,")
    assert fstab_options_to_argv("s3://b", "/m", options) == [
        "mount", "s3://b", "/m", "--region", "eu-west-1"]


@pytest.mark.parametrize("key", sorted(CONTRACT_VALUE_KEYS))
def test_every_value_option_of_the_contract_translates(key: str) -> None:
    argv = fstab_options_to_argv("s3://b/p", "/m", f"{key}=v1")
    assert argv == ["mount", "s3://b/p", "/m", "--" + key.replace("_", "-"), "v1"]


def test_helper_knows_the_contract_options() -> None:
    assert CONTRACT_VALUE_KEYS <= mount_helper.VALUE_OPTIONS
    assert CONTRACT_FLAG_KEYS <= mount_helper.FLAG_OPTIONS
    assert not (mount_helper.VALUE_OPTIONS | mount_helper.FLAG_OPTIONS) & (
        mount_helper.IGNORED_OPTIONS)


def test_translated_options_parse_with_the_cachefs_cli() -> None:
    cli = pytest.importorskip("cachefs.cli.main", reason="cachefs.cli.main not written yet")
    values = sorted(mount_helper.VALUE_OPTIONS)
    flags = sorted(mount_helper.FLAG_OPTIONS)
    options = ",".join([f"{name}=v-{name}" for name in values] + flags + ["_netdev", "rw"])
    argv = fstab_options_to_argv("s3://b/p", "/mnt/data", options)
    args = cli.build_parser().parse_args(argv)
    assert (args.command, args.source, args.mountpoint) == ("mount", "s3://b/p", "/mnt/data")
    for name in values:
        assert getattr(args, name) == f"v-{name}"
    for name in flags:
        assert getattr(args, name) is True
    assert not args.foreground  # mount(8) waits for the helper: cachefs must daemonize


def test_example_config_keys_are_all_mountable_from_fstab() -> None:
    text = (REPO / "systemd" / "example.toml").read_text()
    active = set(tomllib.loads(text))
    # Commented-out settings ("# uid = 1000") are part of the example too.
    documented = set(re.findall(r"^#?\s*([a-z_]+)\s*=", text, re.MULTILINE))
    assert active <= documented
    assert documented - {"source", "mountpoint"} <= CONTRACT_VALUE_KEYS | CONTRACT_FLAG_KEYS
    assert {"source", "mountpoint", "cache_dir", "cache_size", "uid"} <= documented


def test_manifest_and_list_ahead_from_fstab() -> None:
    argv = fstab_options_to_argv("s3://b/p", "/m",
                                 "_netdev,cache_dir=/c,manifest=/etc/cachefs/ds.csv,list_ahead=32")
    assert argv == ["mount", "s3://b/p", "/m", "--cache-dir", "/c",
                    "--manifest", "/etc/cachefs/ds.csv", "--list-ahead", "32"]


def test_value_may_contain_equals_and_colons() -> None:
    argv = fstab_options_to_argv("s3://b", "/m", "endpoint_url=http://h:9000/?a=b")
    assert argv[-2:] == ["--endpoint-url", "http://h:9000/?a=b"]


@pytest.mark.parametrize(("options", "message"), [
    ("cache_size=20G,bogus", "unknown option 'bogus'"),
    ("kernel_cache", "unknown option 'kernel_cache'"),
    ("allow_other=1", "option 'allow_other' takes no value"),
    ("cache_size", "option 'cache_size' needs a value"),
    ("cache_dir=", "option 'cache_dir' needs a value"),
    ("mountpoint=/x", "option 'mountpoint' is not allowed"),
])
def test_bad_options_are_config_errors(options: str, message: str) -> None:
    with pytest.raises(ConfigError) as info:
        fstab_options_to_argv("s3://b", "/m", options)
    assert str(info.value).startswith(message)


def test_sloppy_drops_unknown_options_but_not_malformed_ones() -> None:
    assert fstab_options_to_argv("s3://b", "/m", "bogus,region=r", sloppy=True) == [
        "mount", "s3://b", "/m", "--region", "r"]
    with pytest.raises(ConfigError):
        fstab_options_to_argv("s3://b", "/m", "cache_size", sloppy=True)


def test_main_execs_cachefs_mount_with_this_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[str, list[str]]] = []

    def fake_execv(path: str, args: list[str]) -> None:
        calls.append((path, list(args)))

    monkeypatch.setattr(mount_helper.os, "execv", fake_execv)
    # Exactly what mount(8) passes for the documented fstab line.
    main(["s3://bucket/prefix", "/mnt/data", "-o",
          "rw,cache_dir=/var/cache/cachefs,cache_size=20G,allow_other,_netdev"])
    assert calls == [(sys.executable, [
        sys.executable, "-m", "cachefs", "mount", "s3://bucket/prefix", "/mnt/data",
        "--cache-dir", "/var/cache/cachefs", "--cache-size", "20G", "--allow-other"])]


def test_main_accepts_fuse_type_and_joins_repeated_o(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[list[str]] = []
    monkeypatch.setattr(mount_helper.os, "execv", lambda path, args: calls.append(list(args)))
    main(["s3://b", "/m", "-n", "-t", "fuse.cachefs", "-o", "region=r", "-ouid=7"])
    assert calls[0][3:] == ["mount", "s3://b", "/m", "--region", "r", "--uid", "7"]


def test_main_reports_exec_failure_in_one_line(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    def failing_execv(path: str, args: list[str]) -> None:
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(mount_helper.os, "execv", failing_execv)
    assert main(["s3://b", "/m", "-o", "rw"]) == 1
    err = capsys.readouterr().err
    assert err == f"mount.cachefs: cannot run {sys.executable}: Permission denied\n"


def run_helper(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "cachefs.cli.mount_helper", *args],
        check=False, capture_output=True, text=True, timeout=30, cwd=REPO)


def test_fake_verbose_prints_the_command_and_mounts_nothing() -> None:
    proc = run_helper("s3://b/p", "/mnt/x y", "-f", "-v", "-o", "rw,cache_size=1G,allow_other")
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == (f"mount.cachefs: running {sys.executable} -m cachefs mount "
                           "s3://b/p '/mnt/x y' --cache-size 1G --allow-other\n")


@pytest.mark.parametrize(("args", "message"), [
    (["s3://b", "/m", "-o", "rw,cachesize=1G"], "mount.cachefs: unknown option 'cachesize=1G'"),
    (["s3://b", "/m", "-t", "fuse.sshfs"],
     "mount.cachefs: file system type 'fuse.sshfs' is not cachefs"),
    (["s3://b"], "mount.cachefs: expected SOURCE and MOUNTPOINT; usage: mount.cachefs"),
    (["s3://b", "/m", "-o"], "mount.cachefs: -o needs an argument"),
    (["s3://b", "/m", "-x"], "mount.cachefs: unknown argument '-x'"),
])
def test_errors_are_one_line_and_exit_1(args: list[str], message: str) -> None:
    proc = run_helper(*args)
    assert proc.returncode == 1
    assert proc.stderr.startswith(message)
    assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr
    assert proc.stdout == ""
