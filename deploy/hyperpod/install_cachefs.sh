#!/bin/bash
# Install cachefs on a SageMaker HyperPod (Slurm) node and mount an S3 prefix.
#
# Called from the cluster's on_create.sh as root:
#
#   bash ./install_cachefs.sh s3://BUCKET/PREFIX /mnt/data [REGION] [ENDPOINT_URL]
#
# What it does (every step is safe to repeat):
#   1. apt: fuse3, plus the compiler and headers pyfuse3 builds against;
#   2. a virtualenv at /opt/cachefs/venv with the cachefs package: $CACHEFS_PACKAGE
#      (an s3:// URL of a wheel from `make dist`, copied with the AWS CLI to
#      /opt/cachefs/dist; or anything pip installs: a wheel path, a requirement, a
#      git URL), else the newest cachefs-*.whl next to this script, else the source
#      checkout the script sits in (pip compiles pyfuse3 against the system's
#      libfuse 3, which cachefs uses only to mount; FUSE passthrough needs only
#      Linux >= 6.9 and root);
#   3. cache directory: /opt/dlami/nvme/cachefs/NAME when the instance store is
#      mounted at /opt/dlami/nvme, else /opt/sagemaker/cachefs/NAME; the cache
#      gets $CACHEFS_CACHE_PERCENT (default 80) % of that file system's free space;
#   4. /etc/cachefs/NAME.toml and the systemd template unit cachefs@.service
#      (taken from this script's directory, or systemd/ of a source checkout);
#   5. enables and starts cachefs@NAME; restarts it only when the config changed.
#
# NAME defaults to the last component of the mount point (/mnt/data -> data);
# set CACHEFS_NAME to choose another. Other knobs: CACHEFS_METRICS_ADDR
# (default 127.0.0.1:9477), CACHEFS_MEMORY_BUDGET (default 1G),
# CACHEFS_CACHE_POLICY (default keep), CACHEFS_PYTHON (interpreter for the venv),
# CACHEFS_PASSTHROUGH (auto, the default, or off: `passthrough = "off"` in the
# config), CACHEFS_SHARED_CACHE (s3://BUCKET/PREFIX of a cache tier all nodes
# share; see deploy/shared-cache.md) with CACHEFS_SHARED_CACHE_ENDPOINT_URL and
# CACHEFS_SHARED_CACHE_REGION.
# CACHEFS_ROOT installs into a staging tree instead of / (used by the tests).

set -Eeuo pipefail
shopt -s inherit_errexit

PROG=install_cachefs.sh
trap 'echo "$PROG: failed at line $LINENO: $BASH_COMMAND" >&2' ERR

die() {
    echo "$PROG: $*" >&2
    exit 1
}

log() {
    echo "$PROG: $*"
}

if [[ $# -lt 2 || $# -gt 4 ]]; then
    die "usage: $PROG s3://BUCKET/PREFIX MOUNT_POINT [REGION] [ENDPOINT_URL]"
fi

SOURCE=$1
MOUNT_POINT=$2
REGION=${3:-}
ENDPOINT_URL=${4:-}

[[ $SOURCE == s3://?* ]] || die "bucket must be an s3:// URL, got '$SOURCE'"
[[ $MOUNT_POINT == /* ]] || die "mount point must be an absolute path, got '$MOUNT_POINT'"
MOUNT_POINT=${MOUNT_POINT%/}
[[ -n $MOUNT_POINT ]] || die "refusing to mount over /"

NAME=${CACHEFS_NAME:-$(basename "$MOUNT_POINT")}
[[ $NAME =~ ^[A-Za-z0-9_.-]+$ ]] || die "instance name '$NAME' may only use letters, digits, '_', '.', '-' (set CACHEFS_NAME)"

CACHE_PERCENT=${CACHEFS_CACHE_PERCENT:-80}
[[ $CACHE_PERCENT =~ ^[0-9]+$ && $CACHE_PERCENT -ge 1 && $CACHE_PERCENT -le 95 ]] ||
    die "CACHEFS_CACHE_PERCENT must be a whole number from 1 to 95, got '$CACHE_PERCENT'"
METRICS_ADDR=${CACHEFS_METRICS_ADDR:-127.0.0.1:9477}
MEMORY_BUDGET=${CACHEFS_MEMORY_BUDGET:-1G}
CACHE_POLICY=${CACHEFS_CACHE_POLICY:-keep}

ROOT=${CACHEFS_ROOT:-}
PREFIX=$ROOT/opt/cachefs
VENV=$PREFIX/venv
CONFIG_DIR=$ROOT/etc/cachefs
CONFIG=$CONFIG_DIR/$NAME.toml
UNIT_DIR=$ROOT/etc/systemd/system
SERVICE=cachefs@$NAME.service

[[ $(id -u) -eq 0 ]] || die "must run as root (HyperPod runs lifecycle scripts as root)"

SCRIPT_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
UNIT_SRC=""
for candidate in "$SCRIPT_DIR/cachefs@.service" "$SCRIPT_DIR/../../systemd/cachefs@.service"; do
    if [[ -f $candidate ]]; then
        UNIT_SRC=$candidate
        break
    fi
done
[[ -n $UNIT_SRC ]] || die "cachefs@.service not found: copy systemd/cachefs@.service next to $PROG"

PASSTHROUGH=${CACHEFS_PASSTHROUGH:-auto}
[[ $PASSTHROUGH == auto || $PASSTHROUGH == off ]] ||
    die "CACHEFS_PASSTHROUGH must be auto or off, got '$PASSTHROUGH'"

PACKAGE=${CACHEFS_PACKAGE:-}
if [[ -z $PACKAGE ]]; then
    wheel=$(find "$SCRIPT_DIR" -maxdepth 1 -name 'cachefs-*.whl' | sort -V | tail -n 1)
    if [[ -n $wheel ]]; then
        PACKAGE=$wheel
    elif [[ -f $SCRIPT_DIR/../../pyproject.toml ]]; then
        PACKAGE=$(cd "$SCRIPT_DIR/../.." && pwd)
    else
        die "no cachefs package: put a cachefs-*.whl next to $PROG or set CACHEFS_PACKAGE"
    fi
fi

# --- 1. system packages ---------------------------------------------------------
apt_install() {
    local missing=()
    local pkg
    for pkg in "$@"; do
        dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" ||
            missing+=("$pkg")
    done
    if [[ ${#missing[@]} -gt 0 ]]; then
        log "installing ${missing[*]}"
        DEBIAN_FRONTEND=noninteractive apt-get update -qq
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
    fi
}

python_ok() {
    "$1" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null
}

# libfuse3-dev, pkg-config, gcc, libc6-dev: pip compiles pyfuse3 against the system's libfuse 3
apt_install fuse3 libfuse3-dev pkg-config gcc libc6-dev

PYTHON=${CACHEFS_PYTHON:-}
if [[ -z $PYTHON ]]; then
    for candidate in python3.13 python3.12 python3.11 python3; do
        if command -v "$candidate" >/dev/null && python_ok "$candidate"; then
            PYTHON=$(command -v "$candidate")
            break
        fi
    done
fi
if [[ -z $PYTHON ]]; then
    apt_install python3.11 python3.11-venv python3.11-dev ||
        die "no Python >= 3.11 found and apt cannot install python3.11 (set CACHEFS_PYTHON)"
    PYTHON=$(command -v python3.11)
fi
python_ok "$PYTHON" || die "$PYTHON is older than Python 3.11 (set CACHEFS_PYTHON)"
PY_VERSION=$("$PYTHON" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')
apt_install "python$PY_VERSION-venv" "python$PY_VERSION-dev"

# --- 2. the cachefs package -----------------------------------------------------
if [[ $PACKAGE == s3://* ]]; then
    # A wheel from `make dist` kept in S3: pip needs its file name, so keep it.
    [[ $PACKAGE == *.whl ]] || die "CACHEFS_PACKAGE $PACKAGE: an s3:// package must be a .whl file"
    command -v aws >/dev/null || die "the AWS CLI (aws) is needed to copy $PACKAGE"
    mkdir -p "$PREFIX/dist"
    log "copying $PACKAGE"
    aws s3 cp --only-show-errors "$PACKAGE" "$PREFIX/dist/${PACKAGE##*/}" ||
        die "cannot copy $PACKAGE (does the node's role allow s3:GetObject on it?)"
    PACKAGE=$PREFIX/dist/${PACKAGE##*/}
fi
if [[ ! -x $VENV/bin/python ]]; then
    log "creating $VENV with $PYTHON"
    mkdir -p "$PREFIX"
    "$PYTHON" -m venv "$VENV"
fi
log "installing $PACKAGE into $VENV"
"$VENV/bin/pip" install --quiet --disable-pip-version-check --upgrade "$PACKAGE" ||
    die "pip could not install $PACKAGE into $VENV"
[[ -x $VENV/bin/cachefs ]] || die "$PACKAGE did not install a cachefs command into $VENV/bin"

mkdir -p "$ROOT/usr/local/bin" "$ROOT/sbin"
ln -sfn "$VENV/bin/cachefs" "$ROOT/usr/local/bin/cachefs"
if [[ -x $VENV/bin/mount.cachefs ]]; then
    # mount(8) looks for helpers in /sbin only: makes fstab type cachefs work too.
    ln -sfn "$VENV/bin/mount.cachefs" "$ROOT/sbin/mount.cachefs"
fi

# --- 3. cache directory and size ------------------------------------------------
if [[ -d $ROOT/opt/dlami/nvme ]]; then
    CACHE_BASE=$ROOT/opt/dlami/nvme/cachefs
else
    CACHE_BASE=$ROOT/opt/sagemaker/cachefs
fi
CACHE_DIR=$CACHE_BASE/$NAME
mkdir -p "$CACHE_DIR" "$ROOT$MOUNT_POINT"

# Size from the space that is free plus what this cache already holds, so that
# running the script again on a node with a warm cache gives the same answer.
avail=$(df --output=avail -B1 "$CACHE_DIR" | tail -n 1 | tr -d ' ')
held=$(du -s -B1 "$CACHE_DIR" | cut -f1)
cache_gib=$(( (avail + held) * CACHE_PERCENT / 100 / 1024 / 1024 / 1024 ))
[[ $cache_gib -ge 1 ]] || die "less than 1 GiB free for the cache on $(df --output=target "$CACHE_DIR" | tail -n 1)"
log "cache: $CACHE_DIR, ${cache_gib}G (${CACHE_PERCENT}% of free space)"

# --- 4. configuration and unit --------------------------------------------------
changed=0

# Write $2 to $1 only when the content differs; remember that something changed.
install_file() {
    local target=$1 content=$2 tmp
    if [[ -f $target ]] && [[ "$(cat "$target")" == "$content" ]]; then
        return 0
    fi
    tmp=$(mktemp "$target.XXXXXX")
    printf '%s\n' "$content" >"$tmp"
    chmod 0644 "$tmp"
    mv -f "$tmp" "$target"
    changed=1
    log "wrote $target"
}

toml_string() {
    local value=${1//\\/\\\\}
    printf '"%s"' "${value//\"/\\\"}"
}

config="# Written by $PROG; re-run it (or edit and restart $SERVICE) to change.
source = $(toml_string "$SOURCE")
mountpoint = $(toml_string "$MOUNT_POINT")
cache_dir = $(toml_string "$CACHE_DIR")
cache_size = \"${cache_gib}G\"
cache_policy = $(toml_string "$CACHE_POLICY")
memory_budget = $(toml_string "$MEMORY_BUDGET")
metrics_addr = $(toml_string "$METRICS_ADDR")
allow_other = true"
if [[ -n $REGION ]]; then
    config+=$'\n'"region = $(toml_string "$REGION")"
fi
if [[ -n $ENDPOINT_URL ]]; then
    config+=$'\n'"endpoint_url = $(toml_string "$ENDPOINT_URL")"
fi
if [[ $PASSTHROUGH == off ]]; then
    config+=$'\n'"passthrough = \"off\""
fi
SHARED_CACHE=${CACHEFS_SHARED_CACHE:-}
if [[ -n $SHARED_CACHE ]]; then
    [[ $SHARED_CACHE == s3://?* ]] || die "CACHEFS_SHARED_CACHE must be an s3:// URL, got '$SHARED_CACHE'"
    config+=$'\n'"shared_cache = $(toml_string "$SHARED_CACHE")"
    if [[ -n ${CACHEFS_SHARED_CACHE_ENDPOINT_URL:-} ]]; then
        config+=$'\n'"shared_cache_endpoint_url = $(toml_string "$CACHEFS_SHARED_CACHE_ENDPOINT_URL")"
    fi
    if [[ -n ${CACHEFS_SHARED_CACHE_REGION:-} ]]; then
        config+=$'\n'"shared_cache_region = $(toml_string "$CACHEFS_SHARED_CACHE_REGION")"
    fi
fi

mkdir -p "$CONFIG_DIR" "$UNIT_DIR"
install_file "$CONFIG" "$config"
install_file "$UNIT_DIR/cachefs@.service" "$(cat "$UNIT_SRC")"

# The instance store may be mounted late at boot and comes back empty after a
# stop/start: wait for it and recreate the cache directory before each start.
mkdir -p "$UNIT_DIR/$SERVICE.d"
install_file "$UNIT_DIR/$SERVICE.d/10-cache-dir.conf" "[Unit]
RequiresMountsFor=$CACHE_BASE

[Service]
ExecStartPre=/bin/mkdir -p $CACHE_DIR"

# --- 5. enable and start --------------------------------------------------------
systemctl daemon-reload
systemctl enable --quiet "$SERVICE"
if [[ $changed -eq 1 ]] && systemctl is-active --quiet "$SERVICE"; then
    log "configuration changed: restarting $SERVICE"
    systemctl restart "$SERVICE" || die "$SERVICE failed to restart; see: journalctl -u $SERVICE"
else
    systemctl start "$SERVICE" || die "$SERVICE failed to start; see: journalctl -u $SERVICE"
fi
mountpoint -q "$MOUNT_POINT" || die "$SERVICE is running but $MOUNT_POINT is not mounted; see: journalctl -u $SERVICE"
log "$SOURCE mounted at $MOUNT_POINT ($SERVICE)"
