#!/usr/bin/env bash
# What every run on a real cluster does once the cluster exists, shared by `just e2e` (kind,
# e2e-kind/e2e.sh) and `just e2e-node` (real nodes, tools/real-nodes.sh), so that the two differ
# only in how the cluster is made:
#
#   deploy <dir> [<image>=<new name>:<new tag>]...
#       what a user writes: a kustomization in <dir> of overlays/emulated + components/
#       scheduler-extender straight from the repository with only those images: overrides;
#       `kubectl apply -k`, then `kubectl rollout status` of every DaemonSet and Deployment of it
#   scenarios <logs dir>
#       the e2e crate in cluster mode against $KUBECONFIG (scenarios that need testenv say they
#       are skipped); if it fails: objects, events and every pmem-csi container's log into
#       <logs dir>, exit status 1
#
# kubectl is $KUBECTL (default: kubectl) with $KUBECONFIG. The scenarios' workload image is
# $PMEM_CSI_E2E_IMAGE (default docker.io/library/busybox:1.37).
set -euo pipefail

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
KUBECTL=${KUBECTL:-kubectl}
NAMESPACE=pmem-csi

log() { printf '%s [%4ss] cluster-e2e: %s\n' "$(date +%T)" "$SECONDS" "$*" >&2; }
die() { log "ERROR: $*"; exit 1; }

deploy() { # <dir> [<image>=<name>:<tag>]...
  local dir=$1 rel override t0=$SECONDS w
  shift
  mkdir -p "$dir"
  # Relative: kustomize refuses an absolute directory ("new root '/...' cannot be absolute").
  rel=$(realpath --relative-to="$dir" "$repo/manifests")
  {
    cat <<EOF
apiVersion: kustomize.config.k8s.io/v1beta1
kind: Kustomization
resources:
  - $rel/overlays/emulated
components:
  - $rel/components/scheduler-extender
EOF
    (($#)) && echo "images:"
    for override in "$@"; do
      [[ $override == *=*:* ]] || die "image override $override: want <image>=<new name>:<new tag>"
      local new=${override#*=}
      printf '  - name: %s\n    newName: %s\n    newTag: %s\n' "${override%%=*}" "${new%:*}" "${new##*:}"
    done
  } >"$dir/kustomization.yaml"
  $KUBECTL apply -k "$dir" >/dev/null
  # Every workload the manifests made, not a list kept here by hand.
  local workloads
  workloads=$($KUBECTL -n "$NAMESPACE" get daemonsets,deployments -o name)
  [[ -n $workloads ]] || die "no DaemonSet or Deployment in namespace $NAMESPACE after apply"
  for w in $workloads; do
    $KUBECTL -n "$NAMESPACE" rollout status "$w" --timeout=300s >/dev/null || die "rollout of $w"
  done
  log "applied; rollouts of $(echo "$workloads" | tr '\n' ' ')done $((SECONDS - t0))s after apply"
}

collect() { # <logs dir>
  local logs=$1 pod
  mkdir -p "$logs"
  $KUBECTL get all,pvc,pv,csistoragecapacities,csinodes -A -o wide >"$logs/objects.txt" 2>&1 || true
  $KUBECTL get pvc,pv,csistoragecapacities -A -o yaml >"$logs/objects.yaml" 2>&1 || true
  $KUBECTL get events -A --sort-by=.lastTimestamp >"$logs/events.txt" 2>&1 || true
  for pod in $($KUBECTL -n "$NAMESPACE" get pods -o name); do
    $KUBECTL -n "$NAMESPACE" logs --all-containers --prefix "$pod" >"$logs/${pod#pod/}.log" 2>&1 || true
  done
}

scenarios() { # <logs dir>
  local logs=$1 t0=$SECONDS
  [[ -n ${KUBECONFIG:-} ]] || die "KUBECONFIG must name the cluster (the scenarios would otherwise start testenv)"
  if (cd "$repo" && cargo test -p e2e --test scenarios -- --test-threads=1 --nocapture); then
    log "scenarios passed in $((SECONDS - t0))s"
    return 0
  fi
  collect "$logs"
  die "scenarios failed after $((SECONDS - t0))s; objects, events and logs in $logs"
}

case ${1:-} in
  deploy) shift; (($# >= 1)) || die "usage: deploy <dir> [<image>=<name>:<tag>]..."; deploy "$@" ;;
  scenarios) shift; (($# == 1)) || die "usage: scenarios <logs dir>"; scenarios "$1" ;;
  *) sed -n '/^#   deploy/,/^#       <logs dir>, exit/s/^# \{0,1\}//p' "$0" >&2; exit 2 ;;
esac
