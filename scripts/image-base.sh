#!/usr/bin/env bash
# Make the local base image for the cachefs container image: a Debian bookworm
# minbase root file system from debootstrap, with python3 and fuse3, from the apt
# mirror this machine uses. No container registry is involved.
#
# Usage: scripts/image-base.sh [IMAGE]     (default: localhost/cachefs-base:bookworm)
# Env:   DEBIAN_MIRROR    mirror URL (default: the one apt on this machine uses for bookworm main)
#        SECURITY_MIRROR  security mirror URL (default: the one apt uses for bookworm-security)
#        REBUILD_BASE=1   rebuild even if IMAGE exists (to pick up new security updates)
#
# Needs root, debootstrap and buildah (Debian packages). About a minute; does
# nothing when IMAGE already exists.
set -euo pipefail

image=${1:-localhost/cachefs-base:bookworm}
suite=bookworm
# What the image needs at run time; the build stage of the Containerfile adds compilers.
packages=python3,python3-venv,fuse3,ca-certificates

die() { echo "image-base: $*" >&2; exit 1; }

if [ "${REBUILD_BASE:-0}" != 1 ] && buildah inspect --type image "$image" >/dev/null 2>&1; then
    exit 0
fi
[ "$(id -u)" = 0 ] || die "must run as root (debootstrap creates device nodes and owners)"
for tool in debootstrap buildah; do
    command -v "$tool" >/dev/null || die "$tool not installed (apt-get install $tool)"
done

# The mirror apt uses here for SUITE main (apt's own view, whatever the sources format).
apt_mirror() {
    # shellcheck disable=SC2016  # $(...) are apt's format fields, not shell
    apt-get indextargets --format '$(REPO_URI) $(RELEASE) $(COMPONENT)' 2>/dev/null |
        awk -v suite="$1" '$2 == suite && $3 == "main" { print $1; exit }'
}
mirror=${DEBIAN_MIRROR:-$(apt_mirror "$suite")}
security=${SECURITY_MIRROR:-$(apt_mirror "$suite-security")}
[ -n "$mirror" ] || die "no apt source for $suite main on this machine: set DEBIAN_MIRROR"
mirror=${mirror%/}
security=${security%/}

work=$(mktemp -d /var/tmp/cachefs-base.XXXXXX)
cleanup() {
    umount "$work/rootfs/proc" 2>/dev/null || true
    rm -rf "$work"
    [ -z "${ctr:-}" ] || buildah rm "$ctr" >/dev/null 2>&1 || true
}
trap cleanup EXIT
rootfs=$work/rootfs
cache=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)/build/image-cache/debootstrap  # reused debs
mkdir -p "$cache"

echo "image-base: debootstrap $suite (minbase + $packages) from $mirror"
debootstrap --variant=minbase --include="$packages" --cache-dir="$cache" \
    "$suite" "$rootfs" "$mirror" >"$work/debootstrap.log" 2>&1 \
    || { tail -n 20 "$work/debootstrap.log" >&2; die "debootstrap failed"; }

{
    echo "deb $mirror $suite main"
    echo "deb $mirror $suite-updates main"
    [ -z "$security" ] || echo "deb $security $suite-security main"
} >"$rootfs/etc/apt/sources.list"
# Documentation and translations are never read in the image: leave them out of
# this and every later install.
cat >"$rootfs/etc/dpkg/dpkg.cfg.d/01-cachefs-slim" <<'EOF'
path-exclude /usr/share/doc/*
path-include /usr/share/doc/*/copyright
path-exclude /usr/share/man/*
path-exclude /usr/share/info/*
path-exclude /usr/share/locale/*
EOF
echo 'APT::Install-Recommends "false";' >"$rootfs/etc/apt/apt.conf.d/01-cachefs-no-recommends"

echo "image-base: applying $suite-updates and security updates"
mount -t proc proc "$rootfs/proc"
chroot "$rootfs" /usr/bin/env DEBIAN_FRONTEND=noninteractive sh -c \
    'apt-get update -qq && apt-get -y -qq upgrade >/dev/null && apt-get clean' \
    >>"$work/debootstrap.log" 2>&1 \
    || { tail -n 20 "$work/debootstrap.log" >&2; die "apt-get upgrade in the new root failed"; }
umount "$rootfs/proc"

find "$rootfs/usr/share/doc" -mindepth 1 -not -name copyright -not -type d -delete
find "$rootfs/usr/share/doc" -mindepth 1 -type d -empty -delete
rm -rf "$rootfs"/usr/share/man/* "$rootfs"/usr/share/info/* "$rootfs"/usr/share/locale/* \
    "$rootfs"/var/lib/apt/lists/* "$rootfs"/var/cache/apt/*.bin "$rootfs"/var/cache/apt/archives/*.deb \
    "$rootfs"/var/log/*.log "$rootfs"/var/log/apt/* "$rootfs"/tmp/*

tar --numeric-owner --xattrs -C "$rootfs" -cf "$work/rootfs.tar" .
ctr=$(buildah from scratch)
buildah add --quiet "$ctr" "$work/rootfs.tar" / >/dev/null
buildah config --env PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    --env LANG=C.UTF-8 --cmd /bin/bash \
    --label org.opencontainers.image.description="Debian $suite minbase with $packages" "$ctr"
buildah commit --quiet --rm "$ctr" "$image" >/dev/null
ctr=""
echo "image-base: $image ($(buildah inspect --type image --format '{{.Docker.Created}}' "$image" 2>/dev/null || true))"
