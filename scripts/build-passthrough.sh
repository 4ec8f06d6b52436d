#!/usr/bin/env bash
# Give the venv FUSE passthrough: build libfuse 3.17.2 into VENV/opt/libfuse and
# replace the venv's pyfuse3 with pyfuse3 3.5.0 plus third_party/pyfuse3-passthrough.patch,
# linked (rpath) against that libfuse. See third_party/README.md.
#
# Usage: scripts/build-passthrough.sh [VENV]      (default: .venv of this repository)
# Env:   FUSE_TARBALL_URL  libfuse source tarball (any curl URL, e.g. file:///...)
#        PYFUSE3_SDIST     a local pyfuse3-3.5.0.tar.gz instead of downloading it
#        PASSTHROUGH_PATCH the patch, when this script is not in a source checkout
#                          (default: third_party/pyfuse3-passthrough.patch)
#
# Never fails the caller: if anything goes wrong it prints one line, keeps the stock
# pyfuse3 and exits 0 (cachefs then serves reads itself). Quick when already done.
# Records the outcome in VENV/.passthrough; details go to VENV/opt/build-passthrough.log.
set -euo pipefail

FUSE_VERSION=3.17.2
FUSE_SHA256=3d932431ad94e86179e5265cddde1d67aa3bb2fb09a5bd35c641f86f2b5ed06f
FUSE_TARBALL_URL=${FUSE_TARBALL_URL:-http://deb.debian.org/debian/pool/main/f/fuse3/fuse3_${FUSE_VERSION}.orig.tar.gz}
PYFUSE3_VERSION=3.5.0
PYFUSE3_SHA256=88399a9494b88603230bba300f4ba9ad63fece5ed514ca3633d555a0c6a42b24

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
venv=$(realpath -m "${1:-$repo/.venv}")  # absolute: it ends up in the rpath
py=$venv/bin/python
patch_file=${PASSTHROUGH_PATCH:-$repo/third_party/pyfuse3-passthrough.patch}
prefix=$venv/opt/libfuse
cache=$venv/opt/src
log=$venv/opt/build-passthrough.log
stamp=$venv/.passthrough
if [ ! -f "$patch_file" ]; then
    echo "FUSE passthrough unavailable: $patch_file not found; cachefs will serve reads itself"
    exit 0
fi
key="libfuse $FUSE_VERSION, pyfuse3 $PYFUSE3_VERSION, patch $(sha256sum "$patch_file" | cut -c1-12)"
work=""

fail() {
    echo "FUSE passthrough unavailable: $1; cachefs will serve reads itself"
    echo "unavailable ($key): $1" >"$stamp"
    exit 0
}
trap 'fail "unexpected error (line $LINENO, see $log)"' ERR
trap '[ -z "$work" ] || rm -rf "$work"' EXIT

has_passthrough() {
    "$py" -c 'import pyfuse3; pyfuse3.passthrough_open' 2>/dev/null
}

[ -x "$py" ] || { echo "build-passthrough: no venv at $venv" >&2; exit 0; }
if [ "$(head -n1 "$stamp" 2>/dev/null)" = "ok ($key)" ] && has_passthrough; then
    exit 0
fi

mkdir -p "$cache"
: >"$log"
run() { "$@" >>"$log" 2>&1; }
sha_ok() { echo "$2  $1" | sha256sum -c --status -; }

for tool in cc patch pkg-config curl tar; do
    command -v "$tool" >/dev/null || fail "$tool not installed"
done

# 1. Sources, checked against pinned sha256s and kept in VENV/opt/src.
tarball=$cache/fuse3_$FUSE_VERSION.orig.tar.gz
if ! { [ -f "$tarball" ] && sha_ok "$tarball" "$FUSE_SHA256"; }; then
    run curl -fsSL --connect-timeout 15 --max-time 600 -o "$tarball.part" "$FUSE_TARBALL_URL" \
        || { rm -f "$tarball.part"; fail "cannot download $FUSE_TARBALL_URL"; }
    sha_ok "$tarball.part" "$FUSE_SHA256" \
        || { rm -f "$tarball.part"; fail "sha256 mismatch for $FUSE_TARBALL_URL"; }
    mv "$tarball.part" "$tarball"
fi

sdist=$cache/pyfuse3-$PYFUSE3_VERSION.tar.gz
if [ -n "${PYFUSE3_SDIST:-}" ]; then
    cp "$PYFUSE3_SDIST" "$sdist.part" || fail "cannot read $PYFUSE3_SDIST"
    mv "$sdist.part" "$sdist"
elif [ ! -f "$sdist" ]; then
    run "$py" -m pip download -q --no-binary :all: --no-deps -d "$cache" "pyfuse3==$PYFUSE3_VERSION" \
        || fail "cannot download the pyfuse3 $PYFUSE3_VERSION sdist"
fi
sha_ok "$sdist" "$PYFUSE3_SHA256" || { rm -f "$sdist"; fail "sha256 mismatch for the pyfuse3 $PYFUSE3_VERSION sdist"; }

# 2. Build tools, into the venv.
run "$py" -m pip install -q meson ninja Cython 'setuptools>=78.1.1' 'setuptools_scm>=8' \
    || fail "cannot install the build tools (meson, ninja, Cython, setuptools)"
export PATH=$venv/bin:$PATH

work=$(mktemp -d)

# 3. libfuse into VENV/opt/libfuse (only the library: no fusermount3, no udev rules).
if [ "$(PKG_CONFIG_PATH=$prefix/lib/pkgconfig pkg-config --modversion fuse3 2>/dev/null)" != "$FUSE_VERSION" ] \
    || [ ! -e "$prefix/lib/libfuse3.so" ]; then
    rm -rf "$prefix"
    run tar -xzf "$tarball" -C "$work" || fail "cannot unpack $tarball"
    if ! { run meson setup "$work/fuse-$FUSE_VERSION/build" "$work/fuse-$FUSE_VERSION" \
               --prefix="$prefix" --libdir=lib --buildtype=release \
               -Dutils=false -Dexamples=false -Dtests=false -Dinitscriptdir= -Duseroot=false \
           && run ninja -C "$work/fuse-$FUSE_VERSION/build" install; }; then
        rm -rf "$prefix"
        tail -n 40 "$work/fuse-$FUSE_VERSION/build/meson-logs/meson-log.txt" >>"$log" 2>/dev/null || true
        fail "libfuse $FUSE_VERSION build failed (see $log)"
    fi
fi

# 4. Patched pyfuse3 wheel, linked against that libfuse; tried out before it replaces the stock one.
src=$work/pyfuse3-$PYFUSE3_VERSION
run tar -xzf "$sdist" -C "$work" || fail "cannot unpack $sdist"
run patch -d "$src" -p1 --batch --forward -i "$patch_file" \
    || fail "third_party/pyfuse3-passthrough.patch does not apply to pyfuse3 $PYFUSE3_VERSION"
rm -f "$src/src/pyfuse3/__init__.c"  # pregenerated by the sdist: make Cython regenerate it
PKG_CONFIG_PATH=$prefix/lib/pkgconfig LDFLAGS="-Wl,-rpath,$prefix/lib" \
    SETUPTOOLS_SCM_PRETEND_VERSION="$PYFUSE3_VERSION+passthrough" \
    run "$py" -m pip wheel -q --no-build-isolation --no-deps -w "$work/wheel" "$src" \
    || fail "patched pyfuse3 build failed (see $log)"
wheel=$(echo "$work"/wheel/pyfuse3-*.whl)
run "$py" -m pip install -q --no-deps --target "$work/try" "$wheel" || fail "cannot unpack $wheel"
so=$(echo "$work"/try/pyfuse3/__init__*.so)
ldd "$so" >"$work/ldd" 2>&1 || true
grep -q "$prefix/lib/libfuse3.so" "$work/ldd" || fail "patched pyfuse3 is not linked against libfuse $FUSE_VERSION"
PYTHONPATH=$work/try "$py" -c 'import pyfuse3; pyfuse3.passthrough_open; pyfuse3.FileInfo(backing_id=1)' >>"$log" 2>&1 \
    || fail "patched pyfuse3 does not import (see $log)"

run "$py" -m pip install -q --no-build-isolation --no-deps --force-reinstall "$wheel" \
    || fail "cannot install the patched pyfuse3 (see $log)"
has_passthrough || fail "pyfuse3 in $venv has no passthrough_open after install"
echo "ok ($key)" >"$stamp"
echo "FUSE passthrough available: pyfuse3 $PYFUSE3_VERSION+passthrough on libfuse $FUSE_VERSION (in $prefix)"
