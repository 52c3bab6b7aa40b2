#!/usr/bin/env bash
# Lays out PMEM and node state as PMEM-CSI 1.0 leaves them, on empty regions, for the upgrade
# test in the QEMU guest (tests/vm_guest.rs), and prints the volume IDs it made:
#   layout.sh lvm|direct <state dir>
# lvm: per region one fsdax namespace named pmem-csi (--map=dev, all of the region: its default
# -pmemPercentage=100), wiped and made the only PV of volume group ndbus0<region>fsdax; one
# logical volume per region named by its volume ID (lvcreate -Zn -L <bytes>B). direct: one fsdax
# namespace per volume named by its volume ID, in PMEM-CSI 1.0's sizes (the request rounded up to
# the region's alignment, so usable space is smaller: its issue #933). Each volume gets ext4 as
# PMEM-CSI 1.0 makes it (mkfs.ext4 -b 4096 -E stride=512,stripe_width=512) with a file naming
# the volume, and a state file <id>.json in its format (Go's json.Encoder: compact, newline).
set -euo pipefail

mode=${1:?usage: layout.sh lvm|direct <state dir>}
state=${2:?usage: layout.sh lvm|direct <state dir>}
size=$((64 << 20))

# PMEM-CSI 1.0's volume ID: the name's first 6 bytes, '-', the name's SHA-224 in hex.
volume_id() {
    local hash
    hash=$(printf %s "$1" | sha224sum | cut -d' ' -f1)
    printf '%s-%s\n' "${1:0:6}" "$hash"
}

# The value of a string field in ndctl's JSON output.
json_field() {
    sed -n "s/.*\"$1\":\"\\([^\"]*\\)\".*/\\1/p" | head -n 1
}

fill() {
    local id=$1 device=$2 mnt
    mkfs.ext4 -q -b 4096 -E stride=512,stripe_width=512 -F "$device"
    mnt=$(mktemp -d)
    mount "$device" "$mnt"
    echo "$id" >"$mnt/written-by-pmem-csi-1.0"
    umount "$mnt"
    rmdir "$mnt"
}

write_state() {
    local id=$1 name=$2
    printf '{"id":"%s","size":%d,"parameters":{"deviceMode":"%s","eraseafter":"true","name":"%s"}}\n' \
        "$id" "$size" "$mode" "$name" >"$state/$id.json"
}

for region in region0 region1; do
    name="pvc-$region-0b5d4d3a8b1e3a4a3a9b1c2d"
    id=$(volume_id "$name")
    case $mode in
    lvm)
        region_size=$(ndctl list -R -r "$region" | sed -n 's/.*"size":\([0-9]*\).*/\1/p' | head -n 1)
        device=/dev/$(ndctl create-namespace -r "$region" -m fsdax -M dev -n pmem-csi -s "$region_size" |
            json_field blockdev)
        wipefs --all --force "$device" >/dev/null
        vg=ndbus0${region}fsdax
        vgcreate --force "$vg" "$device" >/dev/null
        lvcreate -Zn -L "${size}B" -n "$id" "$vg" >/dev/null
        fill "$id" "/dev/$vg/$id"
        ;;
    direct)
        device=/dev/$(ndctl create-namespace -r "$region" -m fsdax -M dev -n "$id" -s "$size" |
            json_field blockdev)
        fill "$id" "$device"
        ;;
    *)
        echo "layout.sh: unknown mode $mode" >&2
        exit 2
        ;;
    esac
    write_state "$id" "$name"
    echo "$id"
done
