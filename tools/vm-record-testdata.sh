#!/usr/bin/env bash
# Records, in the guest of tools/vm-run.sh (two fresh emulated 4 GiB NVDIMMs), the real output of
# the ndctl and LVM commands the driver parses, in the states it meets them, into
# testdata/ndctl/ and testdata/lvm/ with a README.md each naming, per file, the command and the
# state. The unit tests parse these files; rerun this after changing the guest's Debian release.
#
# usage: tools/vm-record-testdata.sh
#
# Each recording NAME is NAME.json or NAME.txt (stdout; empty ones only for a success),
# NAME.stderr (when not empty) and, for a failing command, NAME.exit-code. UUIDs, iset_ids and dates differ between runs.
set -euo pipefail

if [[ ${1:-} != --guest ]]; then
    here=$(cd "$(dirname "$0")" && pwd)
    testdata=$(dirname "$here")/testdata
    rm -rf "$testdata/ndctl" "$testdata/lvm"
    mkdir -p "$testdata/ndctl" "$testdata/lvm"
    exec bash "$here/vm-run.sh" --nvdimm-size 4G --share "$here:/mnt/tools" \
        --share "$testdata:/mnt/testdata" -- bash /mnt/tools/vm-record-testdata.sh --guest /mnt/testdata
fi

out=$2
state="(unset)"

# record DIR NAME COMMAND...: runs COMMAND, keeps its output and notes it in DIR/README.md.
record() {
    local sub=$1 dir=$out/$1 name=$2 status ext=txt
    shift 2
    set +e
    "$@" >"$dir/$name.out" 2>"$dir/$name.stderr"
    status=$?
    set -e
    if [[ $* == *json* || $1 == ndctl && $2 == list || $1 == ndctl && $2 == create-namespace ]]; then
        ext=json
    fi
    mv "$dir/$name.out" "$dir/$name.$ext"
    # An empty stdout of a success stays: "ndctl list" prints nothing at all when nothing matches.
    [[ -s $dir/$name.$ext ]] || ((status == 0)) || rm "$dir/$name.$ext"
    [[ -s $dir/$name.stderr ]] || rm "$dir/$name.stderr"
    ((status == 0)) || echo "$status" >"$dir/$name.exit-code"
    local files=() file bt
    bt=$(printf '\140')
    for file in "$dir/$name".*; do
        [[ -e $file ]] && files+=("$bt$(basename "$file")$bt")
    done
    ((${#files[@]})) || files=("(no output)")
    printf '| %s | %s%s%s | %s | %s |\n' "${files[*]}" "$bt" "$*" "$bt" "$status" "$state" >>"$dir/README.md"
    echo "recorded $sub/$name (exit status $status)" >&2
}

readme() {
    cat >"$out/$1/README.md" <<EOF
# $1 recordings

Real output of $2, recorded by \`tools/vm-record-testdata.sh\` in the guest of
\`tools/vm-run.sh\`: Debian $(sed -n 's/^VERSION_CODENAME=//p' /etc/os-release), kernel $(uname -r),
ndctl $(ndctl --version), LVM $(lvm version | sed -n 's/^ *LVM version: *//p'). QEMU emulates two
NVDIMMs of 4 GiB, each with a 128 KiB label area (initialized by the guest's init with
\`ndctl init-labels\`), so there are two pmem regions, region0 and region1. Do not edit these
files: rerun the script.

Per recording: stdout in \`.json\` or \`.txt\` (kept empty for a success that printed nothing), stderr in \`.stderr\` when not empty, the exit
status in \`.exit-code\` when not 0.

| files | command | exit status | state when run |
| --- | --- | --- | --- |
EOF
}
readme ndctl "the ndctl commands the driver runs"
readme lvm "the LVM commands the driver runs"

# ndctl --------------------------------------------------------------------------------------
state="fresh: two regions, no namespaces"
record ndctl list-RNiv-fresh ndctl list --regions --namespaces --idle --verbose
record ndctl list-RN-fresh ndctl list -RN
record ndctl list-Rv-fresh ndctl list -R --verbose
record ndctl list-D-fresh ndctl list -D
record ndctl list-N-fresh ndctl list -N
record ndctl create-namespace-too-large ndctl create-namespace -m fsdax -r region0 -n pmem-csi -s 8G
record ndctl create-namespace-unknown-region ndctl create-namespace -m fsdax -r region9 -n pmem-csi -s 1G
record ndctl create-namespace-unaligned-size ndctl create-namespace -m fsdax -r region0 -n pmem-csi -s 100M
record ndctl destroy-namespace-missing ndctl destroy-namespace -f namespace9.9
record ndctl disable-namespace-missing ndctl disable-namespace namespace9.9
record ndctl create-namespace-fsdax-region0 ndctl create-namespace -m fsdax -r region0 -n pmem-csi -s 1G

state="one fsdax namespace pmem-csi of 1 GiB in region0"
record ndctl list-RNiv-one-fsdax ndctl list -RNiv
record ndctl list-RN-one-fsdax ndctl list -RN
record ndctl create-namespace-name-conflict ndctl create-namespace -m fsdax -r region0 -n pmem-csi -s 1G
record ndctl create-namespace-fsdax-region1 ndctl create-namespace -m fsdax -r region1 -n pvc-5f3c6b62-0b5d-4d3a-8b1e-3a4a3a9b1c2d -s 128M

state="pmem-csi namespaces of 1 GiB (twice, same name) in region0 and fsdax pvc-5f3c6b62-... of 128 MiB in region1"
record ndctl list-RNiv-both-regions ndctl list -RNiv
record ndctl list-RN-both-regions ndctl list -RN
record ndctl list-N-both-regions ndctl list -N
record ndctl list-Rv-both-regions ndctl list -R --verbose
record ndctl list-N-by-region1 ndctl list -N -r region1
record ndctl create-namespace-sector-region1 ndctl create-namespace -m sector -r region1 -n sector-volume -s 256M

state="as before plus a sector namespace sector-volume of 256 MiB in region1"
record ndctl list-RNiv-with-sector ndctl list -RNiv
record ndctl list-RN-with-sector ndctl list -RN
ns=$(ndctl list -N -r region1 | sed -n 's/.*"dev":"\(namespace1\.[0-9]*\)".*/\1/p' | head -1)
record ndctl disable-namespace-ok ndctl disable-namespace "$ns"
record ndctl destroy-namespace-ok ndctl destroy-namespace -f "$ns"
state="after destroying $ns in region1"
record ndctl list-RN-after-destroy ndctl list -RN

# Smallest namespaces ndctl accepts here, in 16 MiB steps (the regions' align), largest first: a
# sector namespace too small for its BTT fails and leaves the region's BTT seed busy, so that every
# later sector namespace in that region fails too (recorded last).
ndctl destroy-namespace -f -r region1 all >/dev/null 2>&1
state="region1 empty: probing the smallest namespaces"
for mode in fsdax sector; do
    for size in 64M 48M 32M 16M; do
        record ndctl "create-namespace-$mode-$size" ndctl create-namespace -m "$mode" -r region1 -n probe -s "$size"
        [[ ! -e $out/ndctl/create-namespace-$mode-$size.exit-code ]] || break
        ndctl destroy-namespace -f -r region1 all >/dev/null 2>&1
    done
done
state="region1 empty after a failed sector create-namespace"
record ndctl create-namespace-sector-after-failure ndctl create-namespace -m sector -r region1 -n probe -s 64M
ndctl destroy-namespace -f -r region1 all >/dev/null 2>&1

# LVM ----------------------------------------------------------------------------------------
vgs_args=(--reportformat json --units b --nosuffix -o "vg_name,vg_size,vg_free,vg_extent_size,pv_count")
lvs_args=(--reportformat json --units b --nosuffix -o "lv_name,vg_name,lv_size,lv_path")
pvs_args=(--reportformat json --units b --nosuffix)
snapshot() {
    record lvm "vgs-$1" vgs "${vgs_args[@]}"
    record lvm "lvs-$1" lvs "${lvs_args[@]}"
    record lvm "pvs-$1" pvs "${pvs_args[@]}"
}

blockdev() { sed -n 's/.*"blockdev":"\([^"]*\)".*/\1/p'; }
pmem0=/dev/$(blockdev <"$out/ndctl/create-namespace-fsdax-region0.json")
pmem1=/dev/$(ndctl create-namespace -m fsdax -r region1 -n pmem-csi -s 512M | blockdev)
state="no PVs"
snapshot no-vg
state="$pmem0 (1 GiB fsdax namespace in region0) and $pmem1 (512 MiB in region1), no PVs"
record lvm wipefs wipefs -a "$pmem0"
record lvm pvcreate pvcreate "$pmem0"
record lvm vgcreate vgcreate ndbus0region0fsdax "$pmem0"
state="VG ndbus0region0fsdax on $pmem0, no LVs"
snapshot 0-lv
record lvm vgs-missing-vg vgs "${vgs_args[@]}" nosuchvg
record lvm vgcreate-already-pv vgcreate other "$pmem0"
record lvm lvcreate-1 lvcreate -Zn -L 64M -n vol1 ndbus0region0fsdax
state="VG ndbus0region0fsdax with LV vol1 (64 MiB)"
snapshot 1-lv
record lvm lvcreate-2 lvcreate -Zn -L 100M -n vol2 ndbus0region0fsdax
state="VG ndbus0region0fsdax with LVs vol1 (64 MiB) and vol2 (100 MiB)"
snapshot 2-lv
record lvm lvs-one-vg lvs "${lvs_args[@]}" ndbus0region0fsdax
record lvm lvcreate-insufficient lvcreate -Zn -L 2G -n big ndbus0region0fsdax
record lvm lvcreate-exists lvcreate -Zn -L 64M -n vol1 ndbus0region0fsdax
record lvm lvcreate-missing-vg lvcreate -Zn -L 64M -n vol1 nosuchvg
record lvm lvremove-missing lvremove -fy ndbus0region0fsdax/nosuchlv
record lvm wipefs-pmem1 wipefs -a "$pmem1"
record lvm vgcreate-2 vgcreate ndbus0region1fsdax "$pmem1"
record lvm lvcreate-region1 lvcreate -Zn -L 32M -n vol3 ndbus0region1fsdax
state="VGs ndbus0region0fsdax (vol1, vol2) and ndbus0region1fsdax (vol3 of 32 MiB)"
snapshot 2-vg
record lvm pvs-2-vg-columns pvs --reportformat json --units b --nosuffix -o pv_name,vg_name,pv_size,pv_free
record lvm lvremove lvremove -fy ndbus0region0fsdax/vol1
state="after removing vol1"
snapshot after-lvremove
