# pmem-csi's one command surface: CI calls these recipes, the README and docs/ document them.

set shell := ["bash", "-euo", "pipefail", "-c"]

# Every test binary finds the pinned Go tools and our binary through these.
export PMEM_CSI_TOOLS_DIR := `bash tools/build.sh --print-dir`
# Prometheus, promtool, shellcheck (Debian) and tsc with Grafana's schema (npm).
export PMEM_CSI_OPS_TOOLS_DIR := `bash tools/ops-tools.sh --print-dir`
# helm, for the chart's lint and render tests (tests/helm_chart.rs).
export PMEM_CSI_HELM_DIR := `bash tools/helm.sh --print-dir`
target_dir := env_var_or_default("CARGO_TARGET_DIR", justfile_directory() / "target")

default:
    @just --list

# Install what the recipes run and this machine lacks (Debian packages such as xfsprogs, and
# just itself), saying what it installs; a no-op when nothing is missing (tools/ensure.sh).
ensure:
    bash tools/ensure.sh

# Build the pinned Kubernetes tools and helm, and fetch the ops tools into the per-machine cache
# (no-op when present).
tools: ensure
    bash tools/build.sh
    bash tools/helm.sh
    bash tools/ops-tools.sh

# What real nodes need beside the control plane (not yet used by `just test`): kubelet, containerd
# with its shim and ctr, runc, the CNI plugins of a bridge network, and the pause and busybox
# images as OCI archives (tools/node-tools.sh; no-op when present).
node-tools: ensure
    bash tools/node-tools.sh

# A real two-node cluster on this machine (kubelet, containerd and kube-proxy per node, each node
# in its own mount and network namespace), its smoke test, then everything removed; fails if the
# test fails or anything is left behind (tools/real-nodes.sh).
real-nodes-smoke: node-tools
    rc=0; { bash tools/real-nodes.sh start && bash tools/real-nodes.sh smoke; } || rc=$?; bash tools/real-nodes.sh stop || rc=1; exit $rc

# pmem-csi as users run it, on real nodes: the real-node cluster and its smoke test, then the
# image (image-oci), the sidecar images and `kubectl apply -k` of the emulated overlay with the
# scheduler-extender component (only images: overridden), every rollout, `verify` (CSINode
# through kubelet's plugin watcher, webhook, extender, a claim written and read back by busybox
# pods, raw block, inline and generic ephemeral volumes, clean-up), then the e2e scenarios in
# cluster mode as kind runs them (tools/cluster-e2e.sh), then the Helm chart in place of the
# kustomize install with a second instance beside it (tools/real-nodes.sh chart); everything
# removed at the end.
e2e-node: node-tools image-oci
    cargo build -p testenv --bin registrar
    cargo test -p e2e --test scenarios --no-run
    bash tools/real-nodes.sh images
    bash tools/helm.sh
    rc=0; { bash tools/real-nodes.sh start && bash tools/real-nodes.sh smoke && bash tools/real-nodes.sh deploy && bash tools/real-nodes.sh verify && bash tools/real-nodes.sh scenarios && bash tools/real-nodes.sh chart; } || rc=$?; bash tools/real-nodes.sh stop || rc=1; exit $rc

# Rebuild the tools from empty Go caches and print per-tool times.
tools-cold:
    bash tools/build.sh --cold

# Compile everything (binaries, tests, benchmarks).
build:
    cargo build --workspace --all-targets

# Formatting and clippy, warnings are errors.
lint:
    cargo fmt --all --check
    cargo clippy --workspace --all-targets -- -D warnings

# Format the code.
fmt:
    cargo fmt --all

# API server audit logs of the integration run, judged by tests/least_privilege.rs.
audit_dir := target_dir / "audit"

# Unit tests, then the integration tests against a real control plane (serialized: 2 cores),
# then least privilege judged over their audit logs. KUBECONFIG is dropped: the e2e scenarios
# would otherwise run against whatever cluster it names instead of testenv.
test: tools build
    env -u KUBECONFIG cargo test --workspace --lib --bins
    rm -rf "{{audit_dir}}"
    env -u KUBECONFIG PMEM_CSI_AUDIT_DIR="{{audit_dir}}" cargo test --workspace --test '*' -- --test-threads=1
    PMEM_CSI_AUDIT_DIR="{{audit_dir}}" cargo test --test least_privilege -- --ignored --nocapture
    cargo run --quiet -p bench -- run --smoke
    cargo run --quiet -p bench -- check

# The e2e scenarios against the cluster of $KUBECONFIG (the driver installed from an overlay with
# the scheduler-extender component); scenarios that need testenv say they are skipped.
e2e-cluster:
    cargo test -p e2e --test scenarios -- --test-threads=1 --nocapture

# A 3-node testenv runs the examples, narrated, then stays up until Ctrl-C (--exit-after-demo: stops).
demo *ARGS: tools
    cargo build --workspace --bins
    cargo run --quiet -p testenv --bin demo -- {{ARGS}}

# The lvm and direct modes on emulated NVDIMMs: tests/vm_guest.rs in a QEMU guest with two PMEM
# regions (tools/vm-test.sh; FILTER picks tests by name). Builds the guest image once per machine.
vm-test *FILTER: tools
    bash tools/vm-test.sh {{FILTER}}

# The QEMU guest's kernel and root file system (Debian's, cached per machine).
vm-image:
    bash tools/vm-image.sh

# The image's runtime tree without Docker (<target>/image/rootfs, its file list beside it).
image-rootfs:
    cargo build --release --bin pmem-csi
    ! grep -qa -e PMEM_CSI_TEST_FAULT_POINT -e PMEM_CSI_TEST_DELAY "{{target_dir}}/release/pmem-csi" || { echo "error: the release binary carries the test hooks" >&2; exit 1; }
    bash tools/image-rootfs.sh "{{target_dir}}/release/pmem-csi" "{{target_dir}}/image/rootfs" "{{target_dir}}/image/files.txt"

# The image as an OCI archive, built by Debian's buildah from the Dockerfile without Docker
# (<target>/pmem-csi.oci.tar; IMAGE names it, default localhost/pmem-csi:dev).
image-oci: image-rootfs
    bash tools/ops-tools.sh
    bash tools/image-oci.sh "$PMEM_CSI_OPS_TOOLS_DIR/bin/buildah" "{{target_dir}}/image" "{{target_dir}}/pmem-csi.oci.tar" "${IMAGE:-localhost/pmem-csi:dev}"

# The e2e scenarios on a kind cluster (needs Docker and kind: not on CI machines).
e2e: image-rootfs
    bash e2e-kind/e2e.sh

# The driver's fuzz targets (driver/tests/fuzz.rs: state files, ndctl and LVM JSON, CSI
# requests, parameters, mount options, volume names) with CASES inputs each in a release build
# (`just test` runs 300 each); prints executions and outcomes per target.
fuzz CASES="200000":
    PMEM_CSI_FUZZ_CASES={{CASES}} cargo test --release -p driver --test fuzz -- --nocapture

# Full benchmarks; results into bench/results/, rendered into BENCHMARKS.md.
bench: tools
    cargo build --release --workspace --bins
    cargo run --release --quiet -p bench -- run

# Re-render BENCHMARKS.md from the committed results.
bench-render:
    cargo run --quiet -p bench -- render

# The fault-injection suite (e2e/tests/faults.rs, also part of `just test`) RUNS times in a row;
# the time to converge per fault goes into bench/results/ and BENCHMARKS.md.
faults RUNS="3": tools
    #!/usr/bin/env bash
    set -euo pipefail
    figures=$(mktemp)
    trap 'rm -f "$figures"' EXIT
    # The suite pauses the driver inside NodeStage: the binary needs the test hooks.
    cargo build --bin pmem-csi --features test-hooks
    for i in $(seq {{RUNS}}); do
        echo "fault suite, run $i of {{RUNS}}"
        env -u KUBECONFIG PMEM_CSI_FAULT_FIGURES="$figures" cargo test -p e2e --test faults -- --test-threads=1
    done
    cargo run --quiet -p bench -- import-faults "$figures"
