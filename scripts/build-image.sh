#!/usr/bin/env bash
# Build the cachefs container image from a wheel made by `make dist`, with buildah.
#
# Usage: scripts/build-image.sh DIST_DIR [IMAGE]     (default IMAGE: localhost/cachefs)
# Env:   BASE   base image (any Debian bookworm image); default: the local
#               localhost/cachefs-base:bookworm, made by scripts/image-base.sh if missing
#
# Tags IMAGE:VERSION, VERSION being the wheel's version with '+' (not allowed in
# image tags) turned into '-'. Stages the build context in build/image/: the
# wheel, requirements.txt (the wheel's own requirements, so the dependency layer
# is reused across versions) and this host's CA bundle for the build stage's
# downloads.
# Runs RUN steps with chroot isolation and the host's network: no daemon, no
# cgroup setup, no registry.
set -euo pipefail

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
dist=${1:?usage: build-image.sh DIST_DIR [IMAGE]}
image=${2:-localhost/cachefs}
base=${BASE:-}

die() { echo "build-image: $*" >&2; exit 1; }

command -v buildah >/dev/null || die "buildah not installed (apt-get install buildah)"
shopt -s nullglob
wheels=("$dist"/cachefs-*.whl)
shopt -u nullglob
[ ${#wheels[@]} -eq 1 ] || die "expected one cachefs wheel in $dist, found ${#wheels[@]} (run make dist)"
wheel=${wheels[0]}
wheel_name=$(basename "$wheel")
version=${wheel_name#cachefs-}
version=${version%%-*}  # (then the wheel's tags: cp311-cp311-linux_x86_64 with the native loop)
tag=${version//+/-}

cd "$repo"
if [ -z "$base" ]; then
    base=localhost/cachefs-base:bookworm
    scripts/image-base.sh "$base"
fi

stage=build/image
rm -rf "$stage"
mkdir -p "$stage"
cp "$wheel" "$stage/"
# Requires-Dist lines without extras markers (pyfuse3 included: the build stage compiles it).
python3 - "$wheel" >"$stage/requirements.txt" <<'EOF'
import email, sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as zf:
    name = next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))
    meta = email.message_from_bytes(zf.read(name))
for req in meta.get_all("Requires-Dist") or []:
    if "extra ==" not in req:
        print(req)
EOF
# The build stage downloads from PyPI with the CAs this host trusts (see Containerfile).
mkdir -p "$stage/certs"
if [ -f /etc/ssl/certs/ca-certificates.crt ]; then
    cp /etc/ssl/certs/ca-certificates.crt "$stage/certs/"
fi

echo "build-image: $image:$tag from $wheel_name on $base"
start=$(date +%s)
buildah bud --layers --isolation chroot --network host \
    --build-arg BASE="$base" --build-arg WHEEL="$wheel_name" --build-arg VERSION="$version" \
    -f Containerfile -t "$image:$tag" .
size=$(buildah images --format '{{.Size}}' "$image:$tag" 2>/dev/null | head -n 1 || true)
echo "build-image: $image:$tag built in $(( $(date +%s) - start )) s${size:+, $size}"
