#!/usr/bin/env bash
# `just e2e`: the e2e scenarios against a kind cluster (needs Docker and kind; not on CI machines).
# Builds the image from `just image-rootfs`'s tree, creates the cluster from kind-config.yaml and
# loads the image; then the steps real nodes share (tools/cluster-e2e.sh): deploys
# overlays/emulated + the scheduler-extender component, waits for every rollout, runs the e2e
# crate against the cluster's KUBECONFIG and collects logs if that fails (kind's too); deletes
# the cluster (kept with KEEP_CLUSTER=1).
set -euo pipefail

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cluster=${CLUSTER:-pmem-csi-e2e}
image=${IMAGE:-ghcr.io/pmem-csi/pmem-csi:e2e}
target=${CARGO_TARGET_DIR:-$repo/target}
work=$(mktemp -d)
kubeconfig=$work/kubeconfig

cleanup() {
    if [[ ${KEEP_CLUSTER:-0} != 1 ]]; then
        kind delete cluster --name "$cluster" >/dev/null 2>&1 || true
    fi
    rm -rf "$work"
}
trap cleanup EXIT

for tool in docker kind kubectl; do
    command -v "$tool" >/dev/null || { echo "e2e: $tool is required" >&2; exit 1; }
done

if kind get clusters 2>/dev/null | grep -qx "$cluster"; then
    # Not ours to delete: the trap would remove it on the way out.
    trap - EXIT
    rm -rf "$work"
    echo "e2e: a kind cluster named $cluster exists; delete it or set CLUSTER" >&2
    exit 1
fi

docker build -f "$repo/Dockerfile" -t "$image" "$target/image"

sed "s|@REPO@|$repo|g" "$repo/e2e-kind/kind-config.yaml" >"$work/kind-config.yaml"
kind create cluster --name "$cluster" --config "$work/kind-config.yaml" \
    --kubeconfig "$kubeconfig" --wait 120s ${KIND_NODE_IMAGE:+--image "$KIND_NODE_IMAGE"}
kind load docker-image --name "$cluster" "$image"
# kind applies the kubeadm v1beta4 patch only with node images of Kubernetes 1.36 and later (and
# a kind release that generates v1beta4 for them); otherwise kube-scheduler runs without the
# extender and every marked pod would stay Pending.
if ! KUBECONFIG=$kubeconfig kubectl -n kube-system get pods -l component=kube-scheduler \
        -o jsonpath='{.items[*].spec.containers[*].command}' | grep -q pmem-csi/scheduler-config.yaml; then
    echo "e2e: kube-scheduler does not run with manifests/scheduler/scheduler-config.yaml; use a kind release and node image (KIND_NODE_IMAGE) of Kubernetes 1.36 or later" >&2
    exit 1
fi

export KUBECONFIG=$kubeconfig
bash "$repo/tools/cluster-e2e.sh" deploy "$work/deploy" "ghcr.io/pmem-csi/pmem-csi=$image"

logs=${LOGS_DIR:-$target/e2e-kind-logs}
if ! bash "$repo/tools/cluster-e2e.sh" scenarios "$logs"; then
    kind export logs --name "$cluster" "$logs/kind" || true
    exit 1
fi
