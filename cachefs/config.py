"""Mount configuration: one table of options, three sources, one validated result.

Every option is declared once in :data:`OPTIONS`. The CLI builds its argparse
flags from the table, ``--config FILE`` (TOML) and ``CACHEFS_<NAME>``
environment variables fill in what the command line left out. Precedence:
flags > environment > file > default.

Values are parsed and validated here (sizes, durations, modes, the S3 URL) so
that every bad input becomes one :class:`~cachefs.errors.ConfigError` line
before anything is started.
"""

from __future__ import annotations

import dataclasses
import os
import re
import tomllib
import urllib.parse
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from cachefs.errors import ConfigError

KiB = 1024
MiB = 1024 * KiB
GiB = 1024 * MiB
TiB = 1024 * GiB

_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgtp]?)(i?b?)\s*$", re.IGNORECASE)
_SIZE_UNITS = {"": 1, "k": KiB, "m": MiB, "g": GiB, "t": TiB, "p": 1024 * TiB}


def parse_size(value: str | int) -> int:
    """Parse ``500M``, ``20G``, ``1T``, ``4MiB``, ``1048576`` (binary units) into bytes."""
    if isinstance(value, int) and not isinstance(value, bool):
        if value < 0:
            raise ConfigError(f"size {value} is negative")
        return value
    if str(value).strip().startswith("-"):
        raise ConfigError(f"invalid size {value!r}: sizes cannot be negative")
    m = _SIZE_RE.match(str(value))
    if not m:
        raise ConfigError(f"invalid size {value!r}: expected a number with an optional "
                          "unit K, M, G, T (e.g. 500M, 20G, 1T)")
    number, unit = float(m.group(1)), m.group(2).lower()
    return int(number * _SIZE_UNITS[unit])


def format_size(n: float) -> str:
    """Bytes for people, binary units: ``300 B``, ``1.5 MiB``, ``2.0 TiB``."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


_DURATION_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h|d)?\s*$", re.IGNORECASE)
_DURATION_UNITS = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400}


def parse_duration(value: str | int | float) -> float:
    """Parse ``300``, ``300s``, ``5m``, ``1h``, ``inf`` into seconds (``inf`` never expires)."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if value != value:  # a TOML nan: no duration (and it passes every range check)
            raise ConfigError(f"invalid duration {value!r}: expected e.g. 30s, 5m, 1h or inf")
        if value < 0:
            raise ConfigError(f"duration {value} is negative")
        return float(value)
    text = str(value).strip().lower()
    if text in ("inf", "infinite", "forever", "never"):
        return float("inf")
    m = _DURATION_RE.match(text)
    if not m:
        raise ConfigError(f"invalid duration {value!r}: expected e.g. 30s, 5m, 1h or inf")
    return float(m.group(1)) * _DURATION_UNITS[(m.group(2) or "s").lower()]


def parse_mode(value: str | int) -> int:
    """Parse an octal permission mode such as ``0444`` or ``555``."""
    if isinstance(value, int) and not isinstance(value, bool):
        # A TOML integer 444 is decimal (0o674): refuse to guess, ask for a string.
        raise ConfigError(f"invalid mode {value!r}: write modes as strings, e.g. \"0444\"")
    else:
        try:
            mode = int(str(value), 8)
        except ValueError:
            raise ConfigError(f"invalid mode {value!r}: expected octal digits like 0444") from None
    if not 0 <= mode <= 0o7777:
        raise ConfigError(f"invalid mode {value!r}: out of range")
    return mode


def parse_bool(value: str | bool) -> bool:
    if isinstance(value, bool):
        return value
    if not isinstance(value, str):  # a TOML 1 or 0.0: say true or false
        raise ConfigError(f"invalid boolean {value!r}: expected true or false")
    text = str(value).strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off", ""):
        return False
    raise ConfigError(f"invalid boolean {value!r}: expected true or false")


def parse_int(value: str | int | float) -> int:
    # (int() would take a TOML 2.5 as 2 and true as 1)
    if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
        raise ConfigError(f"invalid number {value!r}: expected a whole number")
    try:
        result = int(value)
    except (TypeError, ValueError, OverflowError):
        raise ConfigError(f"invalid number {value!r}") from None
    if result < 0:
        raise ConfigError(f"invalid number {value!r}: must not be negative")
    return result


#: ``--registered-files auto`` (the default) gives registered files a 64th of the memory
#: the daemon may use, at about 2 KiB each (the kernel's open file and inode, the daemon's
#: records of it, its remembered lookup), within these bounds: 196,608 files with 24 GiB,
#: 1,048,576 with 128 GiB. The number is the bound on files read each epoch without the
#: daemon's Python: a dataset with more files per node than this registers most of them
#: again every epoch (0.3-0.46 of local disk at 80,000 files against 0.66-0.72 with room).
REGISTERED_FILES_AUTO_MIN = 65536
REGISTERED_FILES_MAX = 1 << 22
_BYTES_PER_REGISTERED_FILE = 2 * KiB


def _memory_limit() -> int:
    """Bytes of memory this process may use: the machine's, or its cgroup's limit when lower
    (a container, a systemd unit with MemoryMax)."""
    memory = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    try:
        text = Path("/sys/fs/cgroup/memory.max").read_text().strip()
    except OSError:
        return memory
    return min(memory, int(text)) if text.isdigit() else memory


def auto_registered_files(memory: int | None = None) -> int:
    """What ``--registered-files auto`` means with ``memory`` bytes (this process's limit
    when None): see :data:`REGISTERED_FILES_AUTO_MIN`."""
    if memory is None:
        memory = _memory_limit()
    share = memory // 64 // _BYTES_PER_REGISTERED_FILE
    return max(REGISTERED_FILES_AUTO_MIN, min(REGISTERED_FILES_MAX, share))


def _registered_files(value: Any) -> int:
    if str(value).strip().lower() == "auto":
        return auto_registered_files()
    return parse_int(value)


# Key names S3 accepts are any UTF-8 up to 1024 bytes; bucket names are DNS-like.
_BUCKET_RE = re.compile(r"^[a-z0-9][a-z0-9.\-_]{1,254}$", re.IGNORECASE)


@dataclasses.dataclass(frozen=True)
class S3Url:
    """``s3://bucket/prefix``; ``prefix`` is empty or ends with ``/``."""

    bucket: str
    prefix: str

    def __str__(self) -> str:
        return f"s3://{self.bucket}/{self.prefix}"


def parse_s3_url(value: str) -> S3Url:
    """Parse ``s3://BUCKET[/PREFIX]``; the prefix is normalised to end with ``/``."""
    if not isinstance(value, str) or not value.startswith("s3://"):
        raise ConfigError(f"invalid source {value!r}: expected s3://BUCKET[/PREFIX]")
    rest = value[len("s3://"):]
    bucket, _, prefix = rest.partition("/")
    if not _BUCKET_RE.match(bucket):
        raise ConfigError(f"invalid bucket name {bucket!r} in {value!r}")
    prefix = prefix.strip("/")
    if "\0" in prefix:
        raise ConfigError(f"invalid prefix in {value!r}: contains NUL")
    return S3Url(bucket, prefix + "/" if prefix else "")


@dataclasses.dataclass(frozen=True)
class Option:
    """One mount option: its name, parser, default and help (the single place it is documented)."""

    name: str
    parse: Callable[[Any], Any]
    default: Any
    help: str
    flag: bool = False  # a switch on the command line (--allow-other)
    metavar: str | None = None

    @property
    def cli(self) -> str:
        return "--" + self.name.replace("_", "-")

    @property
    def env(self) -> str:
        return "CACHEFS_" + self.name.upper()


_TOML_TYPES = {bool: "a boolean", int: "an integer", float: "a number", list: "a list",
               dict: "a table"}


def _text(value: Any, what: str) -> str:
    """``value`` when it is a string: a TOML number, boolean, list, table or date where text
    belongs (``cache_dir = 5``) is an error, not the text of its spelling in Python."""
    if isinstance(value, str):
        return value
    if isinstance(value, os.PathLike):
        return str(os.fspath(value))
    kind = _TOML_TYPES.get(type(value), f"a {type(value).__name__}")
    raise ConfigError(f"invalid {what} {value!r}: expected {what} as a string "
                      f"(in TOML, quoted), got {kind}")


def _path(value: Any) -> Path:
    text = _text(value, "path")
    if not text.strip():
        raise ConfigError("empty path: give a directory or file name")
    return Path(text).expanduser()


def config_mountpoint(value: Any) -> Path:
    """The ``mountpoint`` of a config file as ``cachefs mount --config`` reads it (for
    ``cachefs unmount --config``)."""
    try:
        return _mountpoint(value)
    except ConfigError as exc:
        raise ConfigError(f"mount point: {exc}") from None


def _mountpoint(value: Any) -> Path:
    """The mount point as the kernel will name it: absolute, with the symbolic links on the
    way resolved (the kernel mounts on their target, and the registry, the control socket
    and the readahead must name what it mounted), without looking at the directory
    itself: a hung mount there would hang the look (its check has a timeout)."""
    path = Path(os.path.abspath(_path(value)))
    for _ in range(40):  # (the kernel's own bound on links in a row)
        path = Path(os.path.realpath(path.parent)) / path.name
        try:
            target = os.readlink(path)
        except OSError:  # not a link (or not there: the mount point check says so)
            return path
        path = Path(os.path.abspath(os.path.join(path.parent, target)))
    return path


def _choice(*choices: str) -> Callable[[Any], str]:
    def parse(value: Any) -> str:
        text = _text(value, "value").strip().lower()
        if text not in choices:
            raise ConfigError(f"invalid value {value!r}: expected one of {', '.join(choices)}")
        return text
    return parse


def _opt_str(value: Any) -> str | None:
    return None if value is None or value == "" else _text(value, "value")


def _endpoint_url(value: Any) -> str | None:
    """An S3 endpoint: ``http://`` or ``https://`` with a host and an optional port."""
    text = _opt_str(value)
    if text is None:
        return None
    try:
        url = urllib.parse.urlsplit(text)
        host, _port = url.hostname, url.port  # .port raises ValueError for "host:abc"
    except ValueError:
        host = None
        url = urllib.parse.urlsplit("")
    if url.scheme.lower() not in ("http", "https") or not host:
        raise ConfigError(f"invalid URL {text!r}: expected http://HOST[:PORT] or "
                          "https://HOST[:PORT]")
    return text


def without_password(url: str) -> str:
    """``url`` with the password of its user part (``http://user:password@host``) left
    out, for logs and reports."""
    parts = urllib.parse.urlsplit(url)
    if parts.password is None:
        return url
    netloc = f"{parts.username}:***@{parts.netloc.rpartition('@')[2]}"
    return urllib.parse.urlunsplit(parts._replace(netloc=netloc))


def _opt_int(value: Any) -> int | None:
    return None if value is None or value == "" else parse_int(value)


def _node_name(value: Any) -> str | None:
    if value is None or value == "":
        return None
    name = str(value)
    if len(name) > 253 or any(c.isspace() or not c.isprintable() for c in name):
        raise ConfigError(f"{name!r}: a node name is at most 253 printable characters, "
                          "without spaces")
    return name


def _opt_s3_url(value: Any) -> S3Url | None:
    if value is None or value == "":
        return None
    if isinstance(value, S3Url):
        return value
    return parse_s3_url(str(value))


#: Every mount option, with its default. README's option table is generated from this.
OPTIONS: tuple[Option, ...] = (
    Option("cache_dir", _path, None, "Directory for the block cache and metadata (required).",
           metavar="DIR"),
    Option("cache_size", parse_size, "10G",
           "Disk cache cap (500M, 20G, 1T): the disk space the cache files take, each block "
           "counted in whole file-system blocks (4 KiB), so tiny files count 4 KiB each. "
           "A cache over it (mounted again with a lower value) is evicted down to it, least "
           "recently used first. The index (meta.lmdb) is beside it: a 32nd of it, 8-256 MiB, kept allocated.",
           metavar="SIZE"),
    Option("cache_policy", _choice("keep", "lru"), "keep",
           "Eviction policy: 'keep' admits blocks until the cache is full and then keeps them "
           "(optimal for epochs over a dataset larger than the cache); 'lru' evicts the least "
           "recently used block.", metavar="POLICY"),
    Option("block_size", parse_size, "4M", "Cache block and ranged-GET size.", metavar="SIZE"),
    Option("endpoint_url", _endpoint_url, None,
           "S3 endpoint URL (default: AWS, or AWS_ENDPOINT_URL_S3 / AWS_ENDPOINT_URL).",
           metavar="URL"),
    Option("region", _opt_str, None,
           "Region to sign requests for (default: the bucket's own region, asked from S3 at "
           "mount; else the AWS config's).", metavar="REGION"),
    Option("no_sign_request", parse_bool, False, "Send anonymous requests (public buckets).",
           flag=True),
    Option("metrics_addr", _opt_str, None,
           "Serve Prometheus metrics at http://HOST:PORT/metrics (host defaults to 127.0.0.1; "
           "the conventional cachefs port is 9477).", metavar="HOST:PORT"),
    Option("passthrough", _choice("auto", "off"), "auto",
           "Let the kernel read fully cached files straight from the cache (FUSE passthrough: "
           "needs Linux >= 6.9 and CAP_SYS_ADMIN); 'auto' uses it when available.",
           metavar="auto|off"),
    Option("native_reads", _choice("auto", "off"), "auto",
           "Without passthrough, answer reads of fully cached, verified files in the request "
           "workers' C loop, not in Python (the same check and pins as passthrough); 'auto' "
           "uses it when cachefs was built with it.", metavar="auto|off"),
    Option("registered_files", _registered_files, "auto",
           "Closed, fully cached files kept registered for reads without the daemon "
           "(passthrough, or the C loop) at most, least recently used dropped first: each "
           "holds ~2 KiB of memory (or, without passthrough, also an open file; the "
           "open-file limit may lower it). Eviction drops them too. 'auto' gives them a "
           "64th of the memory (the cgroup's limit if lower): 65,536 to 4,194,304 files.",
           metavar="N|auto"),
    Option("metadata_ttl", parse_duration, "300s",
           "How long a directory listing or object attribute is trusted before S3 is asked "
           "again ('inf' for immutable datasets); an expired listing is still answered while "
           "it is refreshed in the background.", metavar="DURATION"),
    Option("list_ahead", parse_int, 16,
           "Directories listed ahead of a directory walk at once (the sub-directories of each "
           "opened directory are queued; a new mount lists the root and its first "
           "sub-directories down); 0 lists only on demand.", metavar="N"),
    Option("manifest", _opt_str, None,
           "Mount from a manifest instead of listing the bucket: JSON lines or CSV of key, "
           "size, ETag[, mtime], or an S3 Inventory manifest.json (CSV; Parquet needs "
           "pyarrow). Objects not in it are not visible; nothing is ever listed.",
           metavar="FILE"),
    Option("memory_budget", parse_size, "512M",
           "Cap on bytes held in memory for fetches in flight, prefetched and hot blocks.",
           metavar="SIZE"),
    Option("max_connections", parse_int, 256, "Concurrent S3 requests at most.", metavar="N"),
    Option("fuse_workers", parse_int, 4,
           "Threads answering FUSE requests (lookups, opens, reads of cached blocks); more "
           "overlap more waits for the disk, at a CPU cost per request.",
           metavar="N"),
    Option("retry_deadline", parse_duration, "5m",
           "How long a read or listing keeps retrying S3 through outages, throttling and "
           "timeouts before it fails with EIO ('inf' never gives up).", metavar="DURATION"),
    Option("read_ahead", parse_size, "1M",
           "Kernel readahead for the mount (larger FUSE read requests).", metavar="SIZE"),
    Option("allow_other", parse_bool, False, "Let users other than the mounting one read.",
           flag=True),
    Option("uid", _opt_int, None, "Owner of every file (default: the mounting user).",
           metavar="UID"),
    Option("gid", _opt_int, None, "Group of every file (default: the mounting group).",
           metavar="GID"),
    Option("file_mode", parse_mode, "0444", "Permission bits of files.", metavar="MODE"),
    Option("dir_mode", parse_mode, "0555", "Permission bits of directories.", metavar="MODE"),
    Option("shared_cache", _opt_s3_url, None,
           "A cache tier shared by every node of the cluster, between the local cache and "
           "the origin: an S3 Express One Zone directory bucket, a bucket or any S3-compatible "
           "store (e.g. SeaweedFS) in the compute region. Blocks fetched from the origin are "
           "published there; every node uses the same --block-size.", metavar="s3://BUCKET[/PREFIX]"),
    Option("shared_cache_endpoint_url", _opt_str, None,
           "Endpoint URL of the shared cache tier (default: AWS; the zonal endpoint for a "
           "directory bucket).", metavar="URL"),
    Option("shared_cache_region", _opt_str, None,
           "Region of the shared cache tier (default: the one S3 names for its bucket; "
           "until it does, --region, else the AWS config's).",
           metavar="REGION"),
    Option("shared_cache_profile", _opt_str, None,
           "AWS profile with the shared cache tier's credentials (default: the same "
           "credentials as the source).", metavar="PROFILE"),
    Option("shared_cache_timeout", parse_duration, "1s",
           "Latency budget of one shared-tier request: a slower answer counts as a failure, "
           "and 3 failures in a row send reads straight to the origin for a while (circuit "
           "breaker).", metavar="DURATION"),
    Option("node_name", _node_name, None,
           "This node's name in the shared cache tier's fetch leases (default: the host's "
           "name). In a Kubernetes pod without hostNetwork the host's name is the pod's: "
           "give the node's (the downward API's spec.nodeName, as deploy/kubernetes does), "
           "so a pod that replaces another on its node takes over the leases it held.",
           metavar="NAME"),
    Option("start_timeout", parse_duration, "3m",
           "How long 'cachefs mount' waits for its daemon to be ready (without --foreground): "
           "past it the daemon is stopped and the mount fails, leaving nothing mounted; a mount "
           "from a large manifest may need more ('inf' waits as long as it takes).",
           metavar="DURATION"),
    Option("log_level", _choice("debug", "info", "warning", "error"), "info", "Log level.",
           metavar="LEVEL"),
    Option("log_file", _opt_str, None,
           "Log file when running in the background (default: DIR/cachefs.log in the cache dir).",
           metavar="FILE"),
)

OPTIONS_BY_NAME = {o.name: o for o in OPTIONS}


def speculative_window(max_connections: int) -> int:
    """Hinted and swept loads a mount keeps in flight for ``--max-connections``: the
    background share of the connections, 3/4 (more would only wait for one)."""
    return max(1, max_connections * 3 // 4)


@dataclasses.dataclass(frozen=True)
class MountConfig:
    """A complete, validated mount configuration."""

    source: S3Url
    mountpoint: Path
    cache_dir: Path
    cache_size: int
    cache_policy: str
    passthrough: str
    native_reads: str
    registered_files: int
    block_size: int
    endpoint_url: str | None
    region: str | None
    no_sign_request: bool
    metrics_addr: str | None
    metadata_ttl: float
    list_ahead: int
    manifest: str | None
    memory_budget: int
    max_connections: int
    fuse_workers: int
    retry_deadline: float
    read_ahead: int
    allow_other: bool
    uid: int | None
    gid: int | None
    file_mode: int
    dir_mode: int
    shared_cache: S3Url | None
    shared_cache_endpoint_url: str | None
    shared_cache_region: str | None
    shared_cache_profile: str | None
    shared_cache_timeout: float
    node_name: str | None
    start_timeout: float
    log_level: str
    log_file: str | None


def load_config_file(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Read a TOML config file; unknown keys are an error (typos must not pass silently)."""
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError(f"config file {os.fspath(path)!r} does not exist") from None
    except OSError as exc:
        raise ConfigError(f"cannot read config file {os.fspath(path)!r}: {exc.strerror}") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:  # (TOML is UTF-8)
        raise ConfigError(f"config file {os.fspath(path)!r} is not valid TOML: {exc}") from None
    known = set(OPTIONS_BY_NAME) | {"source", "mountpoint"}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ConfigError(f"config file {os.fspath(path)!r}: unknown option {unknown[0]!r}")
    return data


def env_values(environ: Mapping[str, str]) -> dict[str, Any]:
    """Options given as ``CACHEFS_<NAME>`` environment variables."""
    values: dict[str, Any] = {}
    for name in [*OPTIONS_BY_NAME, "source", "mountpoint"]:
        key = "CACHEFS_" + name.upper()
        if key in environ:
            values[name] = environ[key]
    return values


def resolve(
    cli: Mapping[str, Any],
    *,
    environ: Mapping[str, str] | None = None,
    file_values: Mapping[str, Any] | None = None,
) -> MountConfig:
    """Merge the sources (flags > environment > file > default) and validate.

    ``cli`` holds only the options actually given on the command line (None = not given).
    """
    environ = os.environ if environ is None else environ
    merged: dict[str, Any] = {}
    for layer in (file_values or {}, env_values(environ), {k: v for k, v in cli.items()
                                                             if v is not None}):
        merged.update(layer)

    if "source" not in merged:
        raise ConfigError("missing source: give s3://BUCKET[/PREFIX]")
    if "mountpoint" not in merged:
        raise ConfigError("missing mount point")
    values: dict[str, Any] = {"source": parse_s3_url(merged["source"]),
                              "mountpoint": config_mountpoint(merged["mountpoint"])}
    for opt in OPTIONS:
        raw = merged.get(opt.name, opt.default)
        try:
            values[opt.name] = None if raw is None else opt.parse(raw)
        except ConfigError as exc:
            raise ConfigError(f"{opt.cli}: {exc}") from None
    if values["cache_dir"] is None:
        raise ConfigError("missing --cache-dir: cachefs needs a local directory for its cache")
    values["cache_dir"] = values["cache_dir"].absolute()
    _check_cache_outside_mount(values["cache_dir"], values["mountpoint"])
    cfg = MountConfig(**values)
    _check_ranges(cfg)
    return cfg


def _check_cache_outside_mount(cache_dir: Path, mountpoint: Path) -> None:
    """The mount would hide a cache directory inside it (and the daemon's own cache
    writes would go to the mount): refused before anything is created there."""
    cache, mp = Path(os.path.realpath(cache_dir)), Path(os.path.realpath(mountpoint))
    if cache == mp or mp in cache.parents:
        raise ConfigError(f"--cache-dir {cache_dir} is inside the mount point {mountpoint}: "
                          "the mount would hide it; give a directory outside it")


def _check_ranges(cfg: MountConfig) -> None:
    if not 64 * KiB <= cfg.block_size <= 64 * MiB or cfg.block_size & (cfg.block_size - 1):
        raise ConfigError(f"--block-size {format_size(cfg.block_size)}: must be a power of "
                          "two between 64K and 64M")
    if cfg.cache_size < cfg.block_size:
        raise ConfigError(f"--cache-size {format_size(cfg.cache_size)} is too small: it must "
                          f"hold at least one block ({format_size(cfg.block_size)})")
    if cfg.memory_budget < 4 * cfg.block_size:
        raise ConfigError(f"--memory-budget {format_size(cfg.memory_budget)} is too small: it "
                          f"must hold at least 4 blocks ({format_size(4 * cfg.block_size)})")
    if cfg.list_ahead > 256:
        raise ConfigError("--list-ahead must be between 0 and 256")
    if not 1 <= cfg.max_connections <= 1024:
        raise ConfigError("--max-connections must be between 1 and 1024")
    if not 0 <= cfg.registered_files <= REGISTERED_FILES_MAX:
        raise ConfigError(f"--registered-files must be 'auto' or between 0 and "
                          f"{REGISTERED_FILES_MAX}")
    for flag, ident in (("--uid", cfg.uid), ("--gid", cfg.gid)):
        if ident is not None and ident >= 0xFFFFFFFF:  # 32 bits; all ones means "none"
            raise ConfigError(f"{flag} {ident}: must be below 4294967295")
    if not 1 <= cfg.fuse_workers <= 64:
        raise ConfigError("--fuse-workers must be between 1 and 64")
    if cfg.retry_deadline < 1:
        raise ConfigError("--retry-deadline must be at least 1s")
    if cfg.start_timeout < 1:
        raise ConfigError("--start-timeout must be at least 1s")
    if not 4 * KiB <= cfg.read_ahead <= 64 * MiB:
        raise ConfigError("--read-ahead must be between 4K and 64M")
    if not 0.01 <= cfg.shared_cache_timeout <= 60:
        raise ConfigError("--shared-cache-timeout must be between 10ms and 60s")
    if cfg.shared_cache is None and (cfg.shared_cache_endpoint_url or cfg.shared_cache_profile
                                     or cfg.shared_cache_region):
        raise ConfigError("--shared-cache-endpoint-url, --shared-cache-region and "
                          "--shared-cache-profile need --shared-cache s3://BUCKET[/PREFIX]")
    tier = cfg.shared_cache
    same_store = (cfg.shared_cache_endpoint_url is None or (
        cfg.endpoint_url is not None
        and cfg.shared_cache_endpoint_url.rstrip("/") == cfg.endpoint_url.rstrip("/")))
    if (tier is not None and same_store and tier.bucket == cfg.source.bucket
            and tier.prefix.startswith(cfg.source.prefix)):
        raise ConfigError(f"--shared-cache {tier} is inside the source {cfg.source}: the "
                          "blocks it holds would appear in the mount among the dataset's "
                          "files; give a prefix outside the source, or another bucket")
