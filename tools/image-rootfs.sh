#!/usr/bin/env bash
# Assembles the runtime filesystem of the pmem-csi image without Docker:
#   image-rootfs.sh <pmem-csi binary> <output directory> [<file list>]
# Our binary (normal gnu target) goes to /usr/local/bin with the shared libraries `ldd` lists;
# e2fsprogs, xfsprogs, util-linux and mount (losetup), lvm2 and ndctl are unpacked from this
# machine's Debian release (their .debs cached per machine), with the libraries their tools link
# against. The
# Dockerfile copies the same tree; <file list> gets every path in it, one per line.
set -euo pipefail

binary=${1:?usage: image-rootfs.sh <pmem-csi binary> <output directory> [<file list>]}
out=${2:?usage: image-rootfs.sh <pmem-csi binary> <output directory> [<file list>]}
list=${3:-}
# The lvm and direct modes' tools come with the libraries they link against that a build host
# need not have installed (ldd below resolves only what the host has).
packages=(e2fsprogs xfsprogs util-linux mount lvm2 dmsetup ndctl
          libndctl6 libdaxctl1 libaio1 libdevmapper1.02.1 libdevmapper-event1.02.1 libjson-c5
          libkmod2 libiniparser1)
# What the driver runs (mkfs.*, blkid, losetup, wipefs, lvm, ndctl) and what an operator needs
# inside the image.
tools=(sbin/mkfs.ext4 sbin/mkfs.xfs sbin/blkid sbin/losetup sbin/wipefs sbin/e2fsck sbin/xfs_repair
       bin/mount bin/umount sbin/lvm sbin/dmsetup usr/bin/ndctl)

[[ -x $binary ]] || { echo "image-rootfs: $binary is not an executable" >&2; exit 1; }
# shellcheck source=/dev/null
codename=$(. /etc/os-release && echo "${VERSION_CODENAME:?no VERSION_CODENAME in /etc/os-release}")
cache="${PMEM_CSI_CACHE:-$HOME/.cache/pmem-csi}/debs/$codename"
mkdir -p "$cache"
for package in "${packages[@]}"; do
    if ! compgen -G "$cache/${package}_*.deb" >/dev/null; then
        # apt drops privileges to _apt, which cannot write into a root-owned cache.
        # A fresh machine may have empty package lists: update them once and retry.
        (cd "$cache" && { apt-get download -q -o APT::Sandbox::User=root "$package" ||
            { apt-get update -qq && apt-get download -q -o APT::Sandbox::User=root "$package"; }; })
    fi
done

rm -rf "$out"
mkdir -p "$out"
for package in "${packages[@]}"; do
    debs=("$cache/${package}"_*.deb)
    dpkg-deb -x "${debs[-1]}" "$out"
done
install -D -m 0755 "$binary" "$out/usr/local/bin/pmem-csi"

# Each ELF gets the libraries the dynamic loader resolves for it here (same release), the
# loader included, at the paths it resolved them to (tools/libraries.sh: the tree first).
# shellcheck source=tools/libraries.sh
source "$(dirname "${BASH_SOURCE[0]}")/libraries.sh"
copy_libraries "$out/usr/local/bin/pmem-csi" "$out"
for tool in "${tools[@]}"; do
    [[ -x $out/$tool ]] || { echo "image-rootfs: $tool missing from ${packages[*]}" >&2; exit 1; }
    copy_libraries "$out/$tool" "$out"
done
# Documentation and maintainer files are of no use at run time.
rm -rf "$out/usr/share/doc" "$out/usr/share/man" "$out/usr/share/lintian" "$out/usr/share/locale"
mkdir -p "$out/tmp" "$out/etc"
chmod 1777 "$out/tmp"

if [[ -n $list ]]; then
    (cd "$out" && find . -mindepth 1 \( -type f -o -type l \) | sed 's|^\./|/|' | LC_ALL=C sort) >"$list"
fi
echo "image-rootfs: $(du -sh "$out" | cut -f1) in $out"
