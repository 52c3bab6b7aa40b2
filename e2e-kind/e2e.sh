#!/usr/bin/env bash
# `just e2e`: the e2e scenarios against a kind cluster (needs Docker and kind; not on CI machines).
# Builds the image from `just image-rootfs`'s tree, creates the cluster from kind-config.yaml,
# loads the image, deploys overlays/emulated + the scheduler-extender component, waits for it,
# runs the e2e crate against the cluster's KUBECONFIG, collects logs if that fails, and deletes
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

# Relative: kustomize refuses an absolute directory ("new root '/...' cannot be absolute").
manifests=$(realpath --relative-to="$work" "$repo/manifests")
cat >"$work/kustomization.yaml" <<YAML
apiVersion: kustomize.config.k8s.io/v1beta1
kind: Kustomization
resources:
  - $manifests/overlays/emulated
components:
  - $manifests/components/scheduler-extender
images:
  - name: ghcr.io/pmem-csi/pmem-csi
    newName: ${image%:*}
    newTag: ${image##*:}
YAML
export KUBECONFIG=$kubeconfig
kubectl apply -k "$work"
kubectl -n pmem-csi rollout status daemonset/pmem-csi-intel-com-node --timeout=300s
kubectl -n pmem-csi rollout status deployment/pmem-csi-intel-com-controller --timeout=300s
kubectl -n pmem-csi rollout status daemonset/pmem-csi-intel-com-extender --timeout=300s

if ! (cd "$repo" && cargo test -p e2e --test scenarios -- --test-threads=1 --nocapture); then
    logs=${LOGS_DIR:-$repo/target/e2e-kind-logs}
    mkdir -p "$logs"
    kind export logs --name "$cluster" "$logs/kind" || true
    kubectl get all,pvc,pv,csistoragecapacities -A -o wide >"$logs/objects.txt" 2>&1 || true
    kubectl get events -A --sort-by=.lastTimestamp >"$logs/events.txt" 2>&1 || true
    for pod in $(kubectl -n pmem-csi get pods -o name); do
        kubectl -n pmem-csi logs --all-containers --prefix "$pod" >"$logs/${pod#pod/}.log" 2>&1 || true
    done
    echo "e2e: failed; logs in $logs" >&2
    exit 1
fi
