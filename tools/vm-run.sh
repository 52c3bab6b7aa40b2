#!/usr/bin/env bash
# Boots the guest of tools/vm-image.sh under QEMU/KVM with two file-backed emulated NVDIMMs (each
# its own pmem region, with a label area) and runs one command in it. The command's stdout and
# stderr arrive on ours as it runs; we exit with its exit status.
#
# usage: tools/vm-run.sh [options] -- COMMAND [ARG...]
#   --share HOSTDIR:GUESTDIR  share a host directory read-write (9p); repeatable
#   --share-ro HOSTDIR:GUESTDIR
#                             share a host directory read-only, its files cached in the guest
#                             (9p cache=loose): for binaries the host leaves alone while the
#                             guest runs; repeatable
#   --cwd DIR                 the command's working directory in the guest (default /)
#   --nvdimm-size SIZE        size of each NVDIMM (its region), a multiple of 16M (default 4G);
#                             its backing file, sparse, has 128 KiB more for the label area
#   --nvdimm-dir DIR          keep the backing files there, reusing those already there (default:
#                             a fresh temporary directory, removed afterwards)
#   --memory SIZE             guest RAM (default 3G)
#   --log FILE                write the serial console there (default: a temporary file, whose
#                             tail is printed when the guest fails to report)
#   --timeout SECONDS         give up on a guest that has not reported by then (default 600)
#   --accel kvm|tcg           how to run the guest (default: kvm where it works, see below)
#
# KVM needs a host whose KVM runs unmodified guest kernels. Some cloud machines offer /dev/kvm from
# kvm_pvm (pagetable-based nested virtualization), which runs only kernels built as PVM guests: a
# Debian kernel hangs there right after the decompressor's first lines, with no error. On such a
# host, and where /dev/kvm is missing, the guest runs under TCG, several times slower.
#
# In the guest the command runs as root under bash, without a terminal, after the init
# (tools/vm-init.sh) has loaded the NVDIMM, device-mapper and file system modules.
set -euo pipefail

usage() { sed -n '/^# usage:/,/^#   --timeout/p' "$0" | sed 's/^# \{0,1\}//' >&2; exit 2; }

here=$(cd "$(dirname "$0")" && pwd)
shares=()
cwd=/
nvdimm_size=4G
nvdimm_dir=
memory=3G
log=
timeout=600
accel=
while (($#)); do
    case $1 in
        --share) [[ ${2:-} == ?*:/* ]] || usage; shares+=("$2:rw"); shift 2 ;;
        --share-ro) [[ ${2:-} == ?*:/* ]] || usage; shares+=("$2:ro"); shift 2 ;;
        --cwd) cwd=${2:?}; shift 2 ;;
        --nvdimm-size) nvdimm_size=${2:?}; shift 2 ;;
        --nvdimm-dir) nvdimm_dir=${2:?}; shift 2 ;;
        --memory) memory=${2:?}; shift 2 ;;
        --log) log=${2:?}; shift 2 ;;
        --timeout) timeout=${2:?}; shift 2 ;;
        --accel) accel=${2:?}; shift 2 ;;
        --) shift; break ;;
        *) usage ;;
    esac
done
(($#)) || usage

if [[ -z $accel ]]; then
    if [[ -w /dev/kvm && ! -d /sys/module/kvm_pvm ]]; then accel=kvm; else accel=tcg; fi
fi
case $accel in
    # The host CPU model minus IA32_ARCH_CAPABILITIES, which some nested hosts refuse to set.
    kvm) accel_args=(-accel kvm -cpu "host,-arch-capabilities") ;;
    tcg) accel_args=(-accel "tcg,thread=multi" -cpu max) ;;
    *) usage ;;
esac

bash "$here/vm-image.sh"
image=$(bash "$here/vm-image.sh" --print-dir)

tmp=$(mktemp -d "${TMPDIR:-/tmp}/pmem-csi-vm.XXXXXX")
qemu_pid=
# shellcheck disable=SC2317 # called by the EXIT trap
cleanup() {
    [[ -z $qemu_pid ]] || kill "$qemu_pid" 2>/dev/null || true
    rm -rf "$tmp"
}
trap cleanup EXIT
trap 'exit 130' INT TERM
mkdir "$tmp/ctl"
[[ -n $log ]] || log=$tmp/console.log
[[ -n $nvdimm_dir ]] || nvdimm_dir=$tmp/nvdimm
mkdir -p "$nvdimm_dir"

bytes() { numfmt --from=iec "${1%[bB]}"; }
# QEMU's option syntax takes a doubled comma for a comma in a value.
escape() { echo "${1//,/,,}"; }
nvdimm_bytes=$(bytes "$nvdimm_size")
memory_bytes=$(bytes "$memory")

# QEMU keeps the label area in the last bytes of the backend and maps the rest as the DIMM. Were
# the label inside --nvdimm-size, the first region would end, and the second start, 128 KiB short
# of a 16 MiB boundary, and ndctl refuses namespaces there ("misaligned to 16M").
label_bytes=$((128 << 10))
file_bytes=$((nvdimm_bytes + label_bytes))
nvdimm_args=()
for i in 0 1; do
    file=$nvdimm_dir/nvdimm$i.img
    if [[ ! -e $file ]]; then
        truncate -s "$file_bytes" "$file"
    fi
    # A reused file must keep its size: the label area sits at its end.
    size=$(stat -c %s "$file")
    [[ $size == "$file_bytes" ]] || {
        echo "vm-run: $file has $size bytes, not --nvdimm-size $nvdimm_size plus a 128 KiB label area" >&2
        exit 2
    }
    # share=on: guest writes reach the file, so a later boot over --nvdimm-dir sees them.
    nvdimm_args+=(-object "memory-backend-file,id=nvmem$i,share=on,mem-path=$(escape "$file"),size=$file_bytes"
                  -device "nvdimm,id=nvdimm$i,memdev=nvmem$i,label-size=$label_bytes")
done

share_args=()
: >"$tmp/ctl/mounts"
n=0
for share in ${shares[@]+"${shares[@]}"}; do
    access=${share##*:}
    share=${share%:*}
    hostdir=${share%%:/*}
    guestdir=/${share#*:/}
    [[ -d $hostdir ]] || { echo "vm-run: no directory $hostdir to share" >&2; exit 2; }
    # Without a cache, 9p reads every page of a binary from the host at each exec: 1.5-2.5 s
    # for our 300 MB debug binary under TCG, against 0.3 s once cached.
    if [[ $access == ro ]]; then
        virtfs_access=,readonly=on options=cache=loose
    else
        virtfs_access='' options=''
    fi
    share_args+=(-virtfs "local,path=$(escape "$hostdir"),mount_tag=share$n,security_model=none,id=share$n$virtfs_access")
    echo "share$n $guestdir $options" >>"$tmp/ctl/mounts"
    n=$((n + 1))
done
{
    printf 'cd %q || exit 126\nexec' "$cwd"
    printf ' %q' "$@"
    printf '\n'
} >"$tmp/ctl/cmd"

# The kernel unpacks concatenated cpio archives in turn, so our init joins the cached image here;
# first, because the kernel cannot find where a zstd archive ends to look for another after it.
mkdir "$tmp/initfs"
install -m 0755 "$here/vm-init.sh" "$tmp/initfs/init"
(cd "$tmp/initfs" && echo init | cpio --quiet -o -H newc >"$tmp/initrd.img")
cat "$image/initrd.img" >>"$tmp/initrd.img"

# The command's output travels through FIFOs. We hold each open read-write while QEMU runs, so that
# the copying cat neither blocks nor sees an end before QEMU has opened its end, and close them
# once QEMU has exited, so that the cats drain what is left and end.
mkfifo "$tmp/stdout" "$tmp/stderr"
exec 7<>"$tmp/stdout" 8<>"$tmp/stderr"
cat <"$tmp/stdout" 7>&- 8>&- &
cat_out=$!
cat <"$tmp/stderr" >&2 7>&- 8>&- &
cat_err=$!

slots_bytes=$((memory_bytes + 2 * file_bytes))
start=$SECONDS
set +e
timeout --kill-after=10 "$timeout" qemu-system-x86_64 \
    "${accel_args[@]}" -smp 2 -machine pc,nvdimm=on \
    -m "size=$((memory_bytes >> 20))M,slots=2,maxmem=$((slots_bytes >> 20))M" \
    -nodefaults -no-user-config -display none -vga none -no-reboot \
    -kernel "$image/vmlinuz" -initrd "$tmp/initrd.img" \
    -append "console=ttyS0 rdinit=/init panic=-1 quiet" \
    -serial "file:$(escape "$log")" \
    -virtfs "local,path=$(escape "$tmp/ctl"),mount_tag=vmctl,security_model=none,id=vmctl" \
    ${share_args[@]+"${share_args[@]}"} \
    -device virtio-serial-pci,id=vser \
    -chardev "file,id=cmdout,path=$(escape "$tmp/stdout")" -device virtserialport,bus=vser.0,chardev=cmdout,name=stdout \
    -chardev "file,id=cmderr,path=$(escape "$tmp/stderr")" -device virtserialport,bus=vser.0,chardev=cmderr,name=stderr \
    "${nvdimm_args[@]}" \
    7>&- 8>&- </dev/null &
qemu_pid=$!
wait "$qemu_pid"
qemu_status=$?
qemu_pid=
set -e
exec 7>&- 8>&-
wait "$cat_out" "$cat_err" || true

if [[ -f $tmp/ctl/exit-code ]]; then
    exit "$(<"$tmp/ctl/exit-code")"
fi
[[ $log == "$tmp/console.log" ]] && log_name="the console log" || log_name="the console log $log"
if ((qemu_status == 124)); then
    echo "vm-run: the guest did not report within ${timeout}s; $log_name ends with:" >&2
else
    echo "vm-run: the guest stopped after $((SECONDS - start))s without reporting (QEMU exit status $qemu_status); $log_name ends with:" >&2
fi
tail -n 40 "$log" >&2 2>/dev/null || echo "(no console log)" >&2
exit 1
