#!/usr/bin/env bash
# Builds, once per machine, the QEMU/KVM guest the device tests boot (tools/vm-run.sh): this
# machine's Debian release's kernel and a small root filesystem (ndctl, lvm2, xfsprogs, e2fsprogs)
# packed as the initramfs (tools/vm-run.sh appends our /init, tools/vm-init.sh, at each boot, so
# that changing it needs no rebuild). The host kernel here has neither
# device-mapper nor NVDIMMs; the guest has both.
#
# usage: tools/vm-image.sh [--print-dir]
#   --print-dir  print the directory holding vmlinuz and initrd.img and exit
#
# The guest runs entirely from the initramfs (no disk image): unpacking a cpio is faster than any
# block device setup and leaves nothing to fsck or to corrupt between runs.
set -euo pipefail

# Bump when the package lists or the pruning change: the cache key holds it. (The init is not
# in the image.)
RECIPE_VERSION=1
HOST_PACKAGES=(qemu-system-x86 mmdebstrap cpio zstd kmod)
# No udev: devtmpfs provides /dev/pmem*, /dev/dm-*, and the init sets DM_DISABLE_UDEV so that
# libdevmapper and LVM create /dev/mapper/* and /dev/VG/LV themselves; a udev daemon would only add
# boot time and a settle race.
GUEST_PACKAGES=(bash coreutils util-linux mount kmod ndctl lvm2 xfsprogs e2fsprogs)
# Loaded by the init (ACPI NFIT NVDIMMs, their pmem/btt/dax drivers, device-mapper, 9p shares,
# virtio consoles for the command's output) or by the tests (file systems, LVM targets); the
# image keeps only these and what they depend on.
GUEST_MODULES=(nfit libnvdimm nd_pmem nd_btt dax_pmem device_dax dm_mod dm_snapshot dm_thin_pool
               dm_mirror dm_zero 9p 9pnet_virtio virtio_pci virtio_console ext4 xfs loop)

# shellcheck source=/dev/null
codename=$(. /etc/os-release && echo "${VERSION_CODENAME:?no VERSION_CODENAME in /etc/os-release}")
cache_root=${XDG_CACHE_HOME:-$HOME/.cache}/pmem-csi/vm
dir=$cache_root/$codename-$RECIPE_VERSION

if [[ ${1:-} == --print-dir ]]; then
    echo "$dir"
    exit 0
fi

mkdir -p "$cache_root"
exec 9>"$cache_root/.lock"
flock 9

if [[ -f $dir/vmlinuz && -f $dir/initrd.img ]]; then
    exit 0
fi
start=$SECONDS

missing=()
for package in "${HOST_PACKAGES[@]}"; do
    dpkg-query -W -f='${Status}' "$package" 2>/dev/null | grep -q 'install ok installed' ||
        missing+=("$package")
done
if ((${#missing[@]})); then
    # A fresh machine may have empty package lists: update them once and retry.
    apt-get install -y -qq --no-install-recommends "${missing[@]}" ||
        { apt-get update -qq && apt-get install -y -qq --no-install-recommends "${missing[@]}"; }
fi

work=$cache_root/.build-$codename-$RECIPE_VERSION
rm -rf "$work" "$dir"
mkdir -p "$work/debs"
root=$work/root

# The kernel is unpacked rather than installed: installing it pulls in initramfs-tools, whose
# initramfs we would throw away after a minute of building it. linux-image-amd64 is a
# metapackage; its first dependency is the versioned image package.
(cd "$work/debs" && { apt-get download -q -o APT::Sandbox::User=root linux-image-amd64 ||
    { apt-get update -qq && apt-get download -q -o APT::Sandbox::User=root linux-image-amd64; }; })
meta=("$work/debs"/linux-image-amd64_*.deb)
image=$(dpkg-deb -f "${meta[-1]}" Depends | sed -n 's/^\(linux-image-[^ ,]*\).*/\1/p')
[[ -n $image ]] || { echo "vm-image: no kernel package in linux-image-amd64's Depends" >&2; exit 1; }
(cd "$work/debs" && apt-get download -q -o APT::Sandbox::User=root "$image")

# essential: no apt, no init system, nothing the guest never runs. stdin would otherwise be read
# as a sources.list when it is not a terminal.
mmdebstrap --quiet --mode=root --variant=essential --include="$(IFS=,; echo "${GUEST_PACKAGES[*]}")" \
    --dpkgopt='path-exclude=/usr/share/doc/*' --dpkgopt='path-exclude=/usr/share/man/*' \
    --dpkgopt='path-exclude=/usr/share/info/*' --dpkgopt='path-exclude=/usr/share/locale/*' \
    --dpkgopt='path-exclude=/usr/share/lintian/*' \
    "$codename" "$root" </dev/null

kernel_deb=("$work/debs/${image}"_*.deb)
dpkg-deb -x "${kernel_deb[-1]}" "$work/kernel"
kver=$(basename "$(find "$work/kernel/lib/modules" -mindepth 1 -maxdepth 1 -type d -print -quit)")
grep -q '^CONFIG_RD_ZSTD=y' "$work/kernel/boot/config-$kver" ||
    { echo "vm-image: kernel $kver cannot unpack a zstd initramfs" >&2; exit 1; }

# Only the wanted modules and their dependencies, then depmod so modprobe's index matches. The
# package leaves modules.dep to its postinst, so the unpacked tree needs one first.
depmod -b "$work/kernel" "$kver"
mkdir -p "$root/lib/modules/$kver"
cp "$work/kernel/lib/modules/$kver"/modules.{order,builtin,builtin.modinfo} "$root/lib/modules/$kver/"
for module in "${GUEST_MODULES[@]}"; do
    modprobe -d "$work/kernel" -S "$kver" --show-depends "$module" | awk '$1 == "insmod" {print $2}'
done | sort -u | while read -r ko; do
    ko=${ko#"$work/kernel"}
    mkdir -p "$root$(dirname "$ko")"
    cp "$work/kernel$ko" "$root$ko"
done
depmod -b "$root" "$kver"
cp "$work/kernel/boot/vmlinuz-$kver" "$work/vmlinuz"

# Every megabyte of the initramfs costs boot time (under TCG about 0.1 s). Dependencies that none
# of the tools we run needs: Python and the perl modules (xfs_scrub_all, debconf; perl-base
# stays), ICU (xfs_scrub only), iconv modules.
rm -rf "$root/var/cache/apt" "$root/var/lib/apt/lists" "$root/var/log"/* "$root/usr/share/zoneinfo" \
    "$root"/usr/lib/python3* "$root"/usr/share/python3 "$root"/usr/bin/python3* \
    "$root"/usr/lib/x86_64-linux-gnu/perl "$root"/usr/share/perl "$root"/usr/lib/x86_64-linux-gnu/libperl.so* \
    "$root"/usr/lib/x86_64-linux-gnu/libicu* "$root"/usr/sbin/xfs_scrub* \
    "$root"/usr/lib/x86_64-linux-gnu/gconv "$root"/usr/share/bash-completion
# ndctl's modprobe hook runs "ndctl load-keys" before libnvdimm loads; there are no keys here and
# it only prints TPM errors.
rm -f "$root/etc/modprobe.d/nvdimm-security.conf"
(cd "$root" && find . -mount -print0 | LC_ALL=C sort -z |
    cpio --quiet --null -o -H newc | zstd -q -T0 -9 -o "$work/initrd.img")
rm -rf "$root" "$work/kernel" "$work/debs"
echo "$kver" >"$work/kernel-version"
mv "$work" "$dir"
echo "vm-image: built $dir (kernel $kver, initrd $(du -h "$dir/initrd.img" | cut -f1)) in $((SECONDS - start))s" >&2
