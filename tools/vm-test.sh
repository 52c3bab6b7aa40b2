#!/usr/bin/env bash
# The lvm and direct modes on emulated PMEM: builds the driver and tests/vm_guest.rs's test
# binary, boots tools/vm-run.sh's guest (two NVDIMM regions) and runs that binary there with
# --ignored, one test at a time. The repository, the Cargo target directory and the Go tools are
# shared into the guest at their host paths, so the absolute paths compiled into the test binary
# (our binary, csi-sanity, testdata) hold there too.
#   vm-test.sh [test name filter...]
set -euo pipefail

repo=$(cd "$(dirname "$0")/.." && pwd)
cd "$repo"
target=${CARGO_TARGET_DIR:-$repo/target}
tools_dir=$(bash tools/build.sh --print-dir)
[[ -x $tools_dir/csi-sanity ]] || { echo "vm-test: no csi-sanity in $tools_dir (run just tools)" >&2; exit 1; }

cargo build --bin pmem-csi
test_binary=$(cargo test --test vm_guest --no-run --message-format=json 2>/dev/null |
    grep '"kind":\["test"\]' | grep '"name":"vm_guest"' |
    sed -n 's/.*"executable":"\([^"]*\)".*/\1/p' | tail -n 1)
[[ -x $test_binary ]] || { echo "vm-test: cannot find the vm_guest test binary" >&2; exit 1; }

bash tools/vm-image.sh
start=$SECONDS
# 1 GiB per region: the tests size their volumes from the published pools.
bash tools/vm-run.sh \
    --share "$repo:$repo" --share-ro "$target:$target" --share-ro "$tools_dir:$tools_dir" \
    --nvdimm-size 1G --memory 3G --timeout "${VM_TEST_TIMEOUT:-1500}" --cwd "$repo" -- \
    env PMEM_CSI_TOOLS_DIR="$tools_dir" RUST_BACKTRACE=1 \
    "$test_binary" --ignored --test-threads=1 "$@"
echo "vm-test: guest tests passed in $((SECONDS - start))s"
