#!/bin/bash
# The guest's /init (tools/vm-run.sh adds it to the cached initramfs at each boot; the kernel
# runs it as rdinit). It brings up just enough of a system for the device tests, runs the command that
# tools/vm-run.sh put into the control share, reports its exit status there and powers off.
#
# The control share (9p tag vmctl) holds:
#   mounts     lines "TAG GUESTDIR [OPTIONS]": further 9p shares to mount, with extra mount options
#   cmd        a bash script: the command to run
#   exit-code  written here: the command's exit status
# The command's stdout and stderr go to the virtio serial ports named stdout and stderr, which
# vm-run.sh copies to its own; the serial console carries only kernel messages and ours.
set -uo pipefail
export PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin HOME=/root LANG=C.UTF-8
# No udev runs here. LVM, configured for udev, would leave creating /dev/mapper/* and /dev/VG/LV to
# it (lvcreate succeeds, the LV's path never appears); this makes libdevmapper create them itself.
export DM_DISABLE_UDEV=1

say() { echo "vm-init: $*" >/dev/console; }
die() {
    say "$*"
    echo o >/proc/sysrq-trigger
    sleep infinity
}

mount -t proc proc /proc
mount -t sysfs sysfs /sys
mount -t devtmpfs devtmpfs /dev
mkdir -p /dev/pts /dev/shm /run /tmp
mount -t devpts devpts /dev/pts
mount -t tmpfs -o mode=0755 tmpfs /run
mount -t tmpfs -o mode=1777 tmpfs /tmp
mount -t tmpfs -o mode=1777 tmpfs /dev/shm
ln -sf /proc/self/fd /dev/fd
mkdir -p /run/lock /run/lvm

modprobe -a virtio_pci nfit nd_pmem nd_btt dax_pmem dm_mod 9pnet_virtio 9p virtio_console ||
    die "loading modules failed"

# QEMU's NVDIMMs with a label area start with a zeroed one, which the kernel treats as label-less:
# each region is one raw namespace spanning it all, and create-namespace fails. Writing empty label
# indexes (once per fresh backing file: check-labels fails until then) turns them into regions
# whose whole size is available for labelled namespaces. init-labels needs the regions disabled.
fresh=()
for nmem in /sys/bus/nd/devices/nmem*; do
    nmem=$(basename "$nmem")
    ndctl check-labels "$nmem" >/dev/null 2>&1 || fresh+=("$nmem")
done
if ((${#fresh[@]})); then
    { ndctl disable-region all && ndctl init-labels "${fresh[@]}" && ndctl enable-region all; } \
        >/dev/null 2>&1 || die "initializing the labels of ${fresh[*]} failed"
fi

mkdir -p /run/vm
mount -t 9p -o trans=virtio,version=9p2000.L,msize=262144 vmctl /run/vm ||
    die "mounting the control share failed"
while read -r tag guestdir options; do
    [[ -n $tag ]] || continue
    mkdir -p "$guestdir"
    mount -t 9p -o "trans=virtio,version=9p2000.L,msize=262144${options:+,$options}" "$tag" "$guestdir" ||
        die "mounting share $tag at $guestdir failed"
done </run/vm/mounts

port() {
    local name
    for name in /sys/class/virtio-ports/*/name; do
        if [[ $(<"$name") == "$1" ]]; then
            echo "/dev/$(basename "$(dirname "$name")")"
            return
        fi
    done
    die "no virtio port named $1"
}
stdout=$(port stdout)
stderr=$(port stderr)

cd /
bash /run/vm/cmd </dev/null >"$stdout" 2>"$stderr"
echo $? >/run/vm/exit-code.tmp
mv /run/vm/exit-code.tmp /run/vm/exit-code
sync
echo o >/proc/sysrq-trigger
sleep infinity
