"""Unit tests of cachefs.config: parsers, precedence of the sources, validation, README drift."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from cachefs import config
from cachefs.config import (
    OPTIONS,
    GiB,
    KiB,
    MiB,
    TiB,
    auto_registered_files,
    load_config_file,
    parse_duration,
    parse_s3_url,
    parse_size,
    resolve,
)
from cachefs.errors import ConfigError

README = Path(__file__).resolve().parent.parent / "README.md"

BASE_CLI: dict[str, Any] = {"source": "s3://bucket/data", "mountpoint": "/mnt/x", "cache_dir": "/var/cache/x"}


def make(cli: dict[str, Any] | None = None, *, environ: dict[str, str] | None = None,
         file_values: dict[str, Any] | None = None) -> config.MountConfig:
    return resolve({**BASE_CLI, **(cli or {})}, environ=environ or {}, file_values=file_values)


# -- parse_size ---------------------------------------------------------------------------
@pytest.mark.parametrize(("text", "expected"), [
    ("500M", 500 * MiB),
    ("20G", 20 * GiB),
    ("1T", TiB),
    ("4MiB", 4 * MiB),
    ("4MB", 4 * MiB),
    ("64k", 64 * KiB),
    ("64K", 64 * KiB),
    ("1.5G", int(1.5 * GiB)),
    ("1048576", 1048576),
    (" 10G ", 10 * GiB),
    ("0", 0),
    (4096, 4096),
    (0, 0),
])
def test_parse_size_accepts(text: str | int, expected: int) -> None:
    assert parse_size(text) == expected


@pytest.mark.parametrize("bad", ["", "abc", "10X", "-1", "-5M", "M", "1.2.3G", "5 M B", "ten", True, -1])
def test_parse_size_rejects(bad: Any) -> None:
    with pytest.raises(ConfigError):
        parse_size(bad)


# -- parse_duration -------------------------------------------------------------------------
@pytest.mark.parametrize(("text", "expected"), [
    ("inf", float("inf")),
    ("INF", float("inf")),
    ("5m", 300.0),
    ("300", 300.0),
    ("300s", 300.0),
    ("250ms", 0.25),
    ("1h", 3600.0),
    ("2d", 172800.0),
    ("0.5s", 0.5),
    (30, 30.0),
    (1.5, 1.5),
])
def test_parse_duration_accepts(text: str | float, expected: float) -> None:
    assert parse_duration(text) == pytest.approx(expected)


@pytest.mark.parametrize("bad", ["", "5x", "-5s", "m", "5 minutes", -1, "1h30m"])
def test_parse_duration_rejects(bad: Any) -> None:
    with pytest.raises(ConfigError):
        parse_duration(bad)


# -- parse_s3_url ---------------------------------------------------------------------------
@pytest.mark.parametrize(("url", "bucket", "prefix"), [
    ("s3://bucket", "bucket", ""),
    ("s3://bucket/", "bucket", ""),
    ("s3://bucket/data", "bucket", "data/"),
    ("s3://bucket/data/", "bucket", "data/"),
    ("s3://bucket//data//", "bucket", "data/"),
    ("s3://my.bucket-1/a/b/c", "my.bucket-1", "a/b/c/"),
])
def test_parse_s3_url_normalises_prefix(url: str, bucket: str, prefix: str) -> None:
    parsed = parse_s3_url(url)
    assert (parsed.bucket, parsed.prefix) == (bucket, prefix)
    assert str(parsed) == f"s3://{bucket}/{prefix}"


@pytest.mark.parametrize("bad", [
    "bucket/data",  # no scheme
    "http://bucket/data",
    "S3:/bucket",
    "s3://",
    "s3:///data",
    "s3://b",  # too short
    "s3://-bucket",  # must start with a letter or digit
    "s3://bad bucket/x",
    "s3://bucket/a\0b",
])
def test_parse_s3_url_rejects(bad: str) -> None:
    with pytest.raises(ConfigError):
        parse_s3_url(bad)


def test_parse_s3_url_rejects_non_string() -> None:
    with pytest.raises(ConfigError):
        parse_s3_url(None)  # type: ignore[arg-type]


# -- precedence --------------------------------------------------------------------------------
def test_defaults_apply_when_nothing_is_given() -> None:
    cfg = make()
    assert cfg.cache_size == 10 * GiB
    assert cfg.cache_policy == "keep"
    assert cfg.block_size == 4 * MiB
    assert cfg.metadata_ttl == 300.0
    assert cfg.memory_budget == 512 * MiB
    assert cfg.max_connections == 256
    assert cfg.read_ahead == MiB
    assert cfg.file_mode == 0o444 and cfg.dir_mode == 0o555
    assert cfg.no_sign_request is False and cfg.allow_other is False
    assert cfg.endpoint_url is None and cfg.uid is None
    assert cfg.source.bucket == "bucket" and cfg.source.prefix == "data/"
    assert cfg.mountpoint == Path("/mnt/x") and cfg.cache_dir == Path("/var/cache/x")


def test_precedence_flags_over_env_over_file_over_default() -> None:
    file_values = {"cache_size": "1G", "block_size": "1M", "metadata_ttl": "1m", "region": "file-region"}
    environ = {"CACHEFS_CACHE_SIZE": "2G", "CACHEFS_BLOCK_SIZE": "2M"}
    cli = {"cache_size": "3G"}
    cfg = make(cli, environ=environ, file_values=file_values)
    assert cfg.cache_size == 3 * GiB  # flag beats env and file
    assert cfg.block_size == 2 * MiB  # env beats file
    assert cfg.metadata_ttl == 60.0  # file beats default
    assert cfg.region == "file-region"
    assert cfg.memory_budget == 512 * MiB  # default


def test_cli_none_means_not_given() -> None:
    cfg = make({"cache_size": None, "allow_other": None}, environ={"CACHEFS_CACHE_SIZE": "2G",
                                                                    "CACHEFS_ALLOW_OTHER": "true"})
    assert cfg.cache_size == 2 * GiB
    assert cfg.allow_other is True


def test_source_and_mountpoint_from_env_and_file() -> None:
    cfg = resolve({"cache_dir": "/c"}, environ={"CACHEFS_SOURCE": "s3://envbucket/p"},
                  file_values={"source": "s3://filebucket", "mountpoint": "/mnt/file"})
    assert cfg.source.bucket == "envbucket" and cfg.source.prefix == "p/"
    assert cfg.mountpoint == Path("/mnt/file")


def test_env_values_ignore_unrelated_variables() -> None:
    assert config.env_values({"CACHEFS_CACHE_SIZE": "1G", "CACHEFS_BOGUS": "x", "HOME": "/root"}) == {
        "cache_size": "1G"}


def test_resolve_uses_os_environ_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CACHEFS_CACHE_POLICY", "lru")
    cfg = resolve(dict(BASE_CLI))
    assert cfg.cache_policy == "lru"


@pytest.mark.parametrize(("cli", "needle"), [
    ({"source": None}, "missing source"),
    ({"mountpoint": None}, "missing mount point"),
    ({"cache_dir": None}, "--cache-dir"),
    ({"cache_size": "lots"}, "--cache-size"),
    ({"cache_policy": "fifo"}, "--cache-policy"),
    ({"metadata_ttl": "soon"}, "--metadata-ttl"),
    ({"file_mode": "999"}, "--file-mode"),
    ({"allow_other": "maybe"}, "--allow-other"),
    ({"max_connections": "-3"}, "--max-connections"),
    ({"uid": "root"}, "--uid"),
    ({"log_level": "loud"}, "--log-level"),
    ({"source": "gs://bucket"}, "s3://"),
    ({"endpoint_url": "file:///tmp/store"}, "--endpoint-url"),
    ({"endpoint_url": "ftp://host"}, "--endpoint-url"),
    ({"endpoint_url": "localhost:9000"}, "--endpoint-url"),
    ({"endpoint_url": "http://"}, "--endpoint-url"),
    ({"endpoint_url": "http://host:port"}, "--endpoint-url"),
    ({"cache_size": "-5G"}, "negative"),
])
def test_bad_values_name_the_option(cli: dict[str, Any], needle: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(needle)):
        make(cli)


def test_typed_values_from_toml() -> None:
    cfg = make(file_values={"cache_size": 2 * GiB, "no_sign_request": True, "metadata_ttl": "inf",
                            "max_connections": 8, "file_mode": "0440", "uid": 1000})
    assert cfg.cache_size == 2 * GiB
    assert cfg.no_sign_request is True
    assert cfg.metadata_ttl == float("inf")
    assert cfg.max_connections == 8
    assert cfg.file_mode == 0o440
    assert cfg.uid == 1000


# -- range checks --------------------------------------------------------------------------------
@pytest.mark.parametrize(("block", "said"), [("3M", "3.0 MiB"), ("100K", "100.0 KiB"),
                                             ("32K", "32.0 KiB"), ("128M", "128.0 MiB")])
def test_block_size_must_be_power_of_two_in_range(block: str, said: str) -> None:
    with pytest.raises(ConfigError, match=f"--block-size {said}: must be a power of two"):
        make({"block_size": block})


def test_sizes_too_small_are_said_in_units_people_read() -> None:
    with pytest.raises(ConfigError, match=r"--memory-budget 1\.0 KiB is too small: it must hold "
                                          r"at least 4 blocks \(16\.0 MiB\)"):
        make({"memory_budget": "1K"})
    with pytest.raises(ConfigError, match=r"--cache-size 64\.0 KiB is too small: it must hold "
                                          r"at least one block \(4\.0 MiB\)"):
        make({"cache_size": "64K"})


@pytest.mark.parametrize("block", ["64K", "1M", "64M"])
def test_block_size_accepted(block: str) -> None:
    assert make({"block_size": block, "memory_budget": "512M"}).block_size == parse_size(block)


def test_cache_smaller_than_a_block_is_rejected() -> None:
    with pytest.raises(ConfigError, match="--cache-size"):
        make({"cache_size": "2M", "block_size": "4M"})
    assert make({"cache_size": "4M", "block_size": "4M"}).cache_size == 4 * MiB


def test_memory_budget_must_hold_four_blocks() -> None:
    with pytest.raises(ConfigError, match="--memory-budget"):
        make({"memory_budget": "15M", "block_size": "4M"})
    assert make({"memory_budget": "16M", "block_size": "4M"}).memory_budget == 16 * MiB


@pytest.mark.parametrize(("cli", "needle"), [
    ({"max_connections": "0"}, "--max-connections"),
    ({"max_connections": "1025"}, "--max-connections"),
    ({"read_ahead": "1K"}, "--read-ahead"),
    ({"read_ahead": "128M"}, "--read-ahead"),
    ({"registered_files": "4194305"}, "--registered-files"),
    ({"registered_files": "many"}, "invalid number"),
])
def test_other_range_checks(cli: dict[str, Any], needle: str) -> None:
    with pytest.raises(ConfigError, match=needle):
        make(cli)


def test_registered_files_may_be_none_or_many() -> None:
    assert make({"registered_files": "0"}).registered_files == 0
    assert make({"registered_files": "4194304"}).registered_files == 1 << 22
    assert make({"registered_files": "AUTO"}).registered_files == auto_registered_files()


def test_registered_files_by_default_take_a_64th_of_the_memory_at_2_kib_each() -> None:
    assert make({}).registered_files == auto_registered_files()
    assert auto_registered_files(24 * GiB) == 196_608
    assert auto_registered_files(128 * GiB) == 1_048_576
    assert auto_registered_files(2 * GiB) == 65_536, "never fewer than the old fixed bound"
    assert auto_registered_files(2048 * GiB) == 1 << 22, "never more than the range allows"
    assert 65_536 <= auto_registered_files() <= 1 << 22


# -- config file ---------------------------------------------------------------------------------
def test_load_config_file_reads_toml(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    path.write_text('source = "s3://b1/p"\nmountpoint = "/mnt/m"\ncache_dir = "/c"\n'
                    'cache_size = "1G"\nallow_other = true\nmax_connections = 16\n')
    values = load_config_file(path)
    assert values == {"source": "s3://b1/p", "mountpoint": "/mnt/m", "cache_dir": "/c",
                      "cache_size": "1G", "allow_other": True, "max_connections": 16}
    cfg = resolve({}, environ={}, file_values=values)
    assert cfg.cache_size == GiB and cfg.allow_other and cfg.max_connections == 16


def test_load_config_file_missing(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        load_config_file(tmp_path / "nope.toml")


def test_load_config_file_bad_toml(tmp_path: Path) -> None:
    path = tmp_path / "bad.toml"
    path.write_text("cache_size = \n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config_file(path)


def test_load_config_file_unknown_key(tmp_path: Path) -> None:
    path = tmp_path / "typo.toml"
    path.write_text('cache_sise = "1G"\n')
    with pytest.raises(ConfigError, match="unknown option 'cache_sise'"):
        load_config_file(path)


def test_load_config_file_unreadable(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read config file"):
        load_config_file(tmp_path)  # a directory


# -- README drift ----------------------------------------------------------------------------------
def _readme_option_rows() -> dict[str, list[str]]:
    """README's option table as {flag: [flag, key, env, default, meaning]} (backticks stripped)."""
    rows: dict[str, list[str]] = {}
    for line in README.read_text().splitlines():
        if not line.startswith("| `--"):
            continue
        cells = [c.strip().strip("`") for c in line.strip().strip("|").split("|")]
        rows[cells[0]] = cells
    return rows


def test_readme_option_table_lists_every_option() -> None:
    rows = _readme_option_rows()
    assert rows, "README.md has no option table"
    for opt in OPTIONS:
        assert opt.cli in rows, f"{opt.cli} is missing from README's option table"
        row = rows[opt.cli]
        assert row[1] == opt.name, f"{opt.cli}: README config key {row[1]!r} != {opt.name!r}"
        assert row[2] == opt.env, f"{opt.cli}: README environment variable {row[2]!r} != {opt.env!r}"
    assert set(rows) == {o.cli for o in OPTIONS}, "README documents options that do not exist"


def test_readme_option_table_defaults_and_help_match() -> None:
    rows = _readme_option_rows()
    for opt in OPTIONS:
        row = rows[opt.cli]
        if opt.default is None:
            expected_default = "—"
        elif opt.default is False:
            expected_default = "off"
        else:
            expected_default = str(opt.default)
        assert row[3] == expected_default, f"{opt.cli}: README default {row[3]!r}, code {opt.default!r}"
        assert row[4] == opt.help, f"{opt.cli}: README meaning differs from the option's help"


def test_mode_from_toml_integer_is_not_silently_decimal() -> None:
    from_flag = make({"file_mode": "444"}).file_mode
    assert from_flag == 0o444
    try:
        from_file = make(file_values={"file_mode": 444}).file_mode
    except ConfigError:
        return  # rejecting an ambiguous integer mode is fine too
    assert from_file == from_flag


def test_node_name_from_the_environment_and_its_bounds() -> None:
    assert make().node_name is None
    assert make(environ={"CACHEFS_NODE_NAME": "ip-10-0-1-17.ec2.internal"}).node_name == \
        "ip-10-0-1-17.ec2.internal"
    assert make(environ={"CACHEFS_NODE_NAME": ""}).node_name is None  # (the var unset)
    for bad in ("two words", "x" * 254, "tab\there"):
        with pytest.raises(ConfigError, match="--node-name"):
            make({"node_name": bad})


# -- the shared cache tier ------------------------------------------------------------------
def test_shared_cache_options_from_each_source() -> None:
    assert make().shared_cache is None
    cfg = make({"shared_cache": "s3://cache--usw2-az1--x-s3/ds1"},
               environ={"CACHEFS_SHARED_CACHE_REGION": "us-west-2"},
               file_values={"shared_cache_timeout": "250ms",
                            "shared_cache_endpoint_url": "http://127.0.0.1:8333"})
    assert cfg.shared_cache == config.S3Url("cache--usw2-az1--x-s3", "ds1/")
    assert cfg.shared_cache_region == "us-west-2"
    assert cfg.shared_cache_timeout == 0.25
    assert cfg.shared_cache_endpoint_url == "http://127.0.0.1:8333"
    assert make({"shared_cache": "s3://cache"}).shared_cache_timeout == 1.0


@pytest.mark.parametrize(("cli", "needle"), [
    ({"shared_cache": "http://x"}, "--shared-cache: invalid source"),
    ({"shared_cache": "s3://ok", "shared_cache_timeout": "2m"}, "--shared-cache-timeout"),
    ({"shared_cache_endpoint_url": "http://127.0.0.1:1"}, "need --shared-cache"),
    ({"shared_cache_profile": "cache"}, "need --shared-cache"),
])
def test_shared_cache_bad_values(cli: dict[str, Any], needle: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(needle)):
        make(cli)


@pytest.mark.parametrize(("cli", "refused"), [
    ({"shared_cache": "s3://bucket/data/cache"}, True),
    ({"shared_cache": "s3://bucket/data"}, True),
    ({"shared_cache": "s3://bucket/data/cache", "endpoint_url": "http://10.0.0.1:9000",
      "shared_cache_endpoint_url": "http://10.0.0.1:9000/"}, True),
    ({"source": "s3://bucket", "shared_cache": "s3://bucket/cache"}, True),
    ({"shared_cache": "s3://bucket/cache"}, False),
    ({"shared_cache": "s3://bucket/datasets"}, False),
    ({"shared_cache": "s3://other/data/cache"}, False),
    ({"shared_cache": "s3://bucket/data/cache",
      "shared_cache_endpoint_url": "http://127.0.0.1:8333"}, False),  # (another store)
], ids=["under-the-source", "the-source", "same-endpoint", "under-the-bucket-root",
        "beside", "beside-similar-name", "other-bucket", "other-store"])
def test_a_shared_tier_inside_the_source_is_refused(cli: dict[str, Any], refused: bool) -> None:
    """A tier in the source's own bucket, under the mounted prefix: the blocks it
    published appeared in the mount as files (cache/v1/<hash>/0000000000...) among the
    dataset's, and a training script walking the folder read them as samples."""
    if refused:
        with pytest.raises(ConfigError, match=re.escape("inside the source")):
            make(cli)
    else:
        assert make(cli).shared_cache is not None


@pytest.mark.parametrize("url", ["http://127.0.0.1:9000", "https://s3.eu-west-1.amazonaws.com",
                                 "http://[::1]:8333/", "HTTPS://minio.internal"])
def test_endpoint_urls_accepted(url: str) -> None:
    assert make({"endpoint_url": url}).endpoint_url == url


def test_list_ahead_and_manifest_from_every_source() -> None:
    assert make({}).list_ahead == 16 and make({}).manifest is None
    assert make({"list_ahead": "4"}).list_ahead == 4
    assert make({}, environ={"CACHEFS_LIST_AHEAD": "0", "CACHEFS_MANIFEST": "/m.csv"}).list_ahead == 0
    assert make({}, environ={"CACHEFS_MANIFEST": "/m.csv"}).manifest == "/m.csv"
    cfg = make(file_values={"list_ahead": 32, "manifest": "/data/inventory/manifest.json"})
    assert (cfg.list_ahead, cfg.manifest) == (32, "/data/inventory/manifest.json")
    with pytest.raises(ConfigError, match="--list-ahead"):
        make({"list_ahead": "1000"})
    with pytest.raises(ConfigError, match="--list-ahead"):
        make({"list_ahead": "many"})
