#!/usr/bin/env bash
# Builds the real Kubernetes components the tests run against, from the Go module proxy, into a
# per-machine cache outside the repository. Each tool is rebuilt only when its pin changes; a lock
# makes concurrent builders (two test binaries, CI and a developer) wait for each other.
#
# usage: tools/build.sh [--cold] [--with-kubelet] [--print-dir]
#   --cold          empty the tool, module and build caches first and print per-tool times
#   --with-kubelet  also build kubelet and kube-proxy (for real nodes, tools/node-tools.sh), from the same module
#                   as kube-apiserver so that it reuses the packages compiled for the control plane
#   --print-dir     print the directory holding the binaries and exit
set -euo pipefail

K8S_VERSION=v1.37.2
STAGING_VERSION=v0.37.2
ETCD_VERSION=v3.7.3
PROVISIONER_VERSION=v6.3.0
# external-provisioner v6.3.0 is built against Kubernetes 1.36 libraries; lifting them to 0.37
# through MVS could break its build, so it gets its own module with its own staging pins.
PROVISIONER_K8S_VERSION=v1.36.1
PROVISIONER_STAGING_VERSION=v0.36.1
# external-resizer (csi-resizer) beside the controller: node-only expansion (docs/node-driver.md).
RESIZER_VERSION=v2.3.0
# csi-test v5.5.0 (the recipe's first choice) is not served by the proxy; v5.4.0 is what
# external-provisioner v6.3.0 itself pins.
CSI_TEST_VERSION=v5.4.0

here=$(cd "$(dirname "$0")" && pwd)
cache_root=${XDG_CACHE_HOME:-$HOME/.cache}/pmem-csi/tools
pin="k8s-$K8S_VERSION.etcd-$ETCD_VERSION.prov-$PROVISIONER_VERSION.resizer-$RESIZER_VERSION.sanity-$CSI_TEST_VERSION"
dir=$cache_root/$pin
bin=$dir/bin

cold=false
with_kubelet=false
for arg in "$@"; do
  case $arg in
    --print-dir) echo "$bin"; exit 0 ;;
    --cold) cold=true ;;
    --with-kubelet) with_kubelet=true ;;
    *) echo "usage: tools/build.sh [--cold] [--with-kubelet] [--print-dir]" >&2; exit 2 ;;
  esac
done

if ! command -v go >/dev/null 2>&1; then
  echo "error: 'go' not found. Install Go >= 1.26 with access to a Go module proxy (Debian's golang-1.19 is too old)." >&2
  exit 1
fi

mkdir -p "$cache_root"
exec 9>"$cache_root/.lock"
flock 9

if $cold; then
  echo "cold build: removing $cache_root/*, the Go module cache and the Go build cache" >&2
  rm -rf "${cache_root:?}"/k8s-* 
  go clean -modcache
  go clean -cache
fi

mkdir -p "$bin"
export CGO_ENABLED=0 GOFLAGS=-mod=mod GOTOOLCHAIN=local

# Writes replace lines for every staging module k8s.io/kubernetes@$1 resolves from ./staging/src.
staging_replaces() {
  local k8s=$1 staging=$2 gomod
  gomod=$(go list -m -json "k8s.io/kubernetes@$k8s" | sed -n 's/.*"GoMod": "\(.*\)".*/\1/p')
  grep -E '=> \./staging/src/' "$gomod" | awk '{print $1}' | sort -u |
    while read -r m; do go mod edit -replace="$m=$m@$staging"; done
}

# The build module of one tool (the staging replaces of k8s.io/kubernetes' come from its own go.mod
# when the module is made afresh).
# shellcheck source=tools/go-module.sh
source "$here/go-module.sh"

k8s_ldflags() {
  local v=$1 minor
  minor=$(echo "$v" | cut -d. -f2)
  local f="-s -w"
  for p in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
    f+=" -X $p.gitVersion=$v -X $p.gitMajor=1 -X $p.gitMinor=$minor -X $p.gitTreeState=clean"
  done
  echo "$f"
}

build_kubernetes() {
  local m; m=$(module_dir kubernetes "k8s.io/kubernetes $K8S_VERSION")
  (
    cd "$m"
    if [[ ! -f go.mod ]]; then
      go mod init pmem-csi-tools.invalid/kubernetes >/dev/null 2>&1
      staging_replaces "$K8S_VERSION" "$STAGING_VERSION"
    fi
    local pkgs=()
    for c in "${k8s_cmds[@]}"; do pkgs+=("k8s.io/kubernetes/cmd/$c@$K8S_VERSION"); done
    go get "${pkgs[@]}"
    # Only what is missing: kubelet is often added to a cache that already has the control plane.
    for c in "${k8s_cmds[@]}"; do
      [[ -x $bin/$c ]] && continue
      timed "$c" go build -p 2 -trimpath -ldflags "$(k8s_ldflags "$K8S_VERSION")" -o "$bin/$c.tmp" "k8s.io/kubernetes/cmd/$c"
      mv "$bin/$c.tmp" "$bin/$c"
    done
  )
}

build_etcd() {
  local m; m=$(module_dir etcd "go.etcd.io/etcd/server/v3 $ETCD_VERSION")
  (
    cd "$m"
    [[ -f go.mod ]] || go mod init pmem-csi-tools.invalid/etcd >/dev/null 2>&1
    go get "go.etcd.io/etcd/server/v3@$ETCD_VERSION"
    timed etcd go build -p 2 -trimpath -ldflags "-s -w" -o "$bin/etcd.tmp" go.etcd.io/etcd/server/v3
    mv "$bin/etcd.tmp" "$bin/etcd"
  )
}

build_provisioner() {
  local m; m=$(module_dir provisioner "github.com/kubernetes-csi/external-provisioner/v6 $PROVISIONER_VERSION")
  (
    cd "$m"
    if [[ ! -f go.mod ]]; then
      go mod init pmem-csi-tools.invalid/provisioner >/dev/null 2>&1
      staging_replaces "$PROVISIONER_K8S_VERSION" "$PROVISIONER_STAGING_VERSION"
    fi
    local p=github.com/kubernetes-csi/external-provisioner/v6/cmd/csi-provisioner
    go get "$p@$PROVISIONER_VERSION"
    timed csi-provisioner go build -p 2 -trimpath -ldflags "-s -w -X main.version=$PROVISIONER_VERSION" -o "$bin/csi-provisioner.tmp" "$p"
    mv "$bin/csi-provisioner.tmp" "$bin/csi-provisioner"
  )
}

build_resizer() {
  local m; m=$(module_dir resizer "github.com/kubernetes-csi/external-resizer/v2 $RESIZER_VERSION")
  (
    cd "$m"
    [[ -f go.mod ]] || go mod init pmem-csi-tools.invalid/resizer >/dev/null 2>&1
    local p=github.com/kubernetes-csi/external-resizer/v2/cmd/csi-resizer
    go get "$p@$RESIZER_VERSION"
    timed csi-resizer go build -p 2 -trimpath -ldflags "-s -w -X main.version=$RESIZER_VERSION" -o "$bin/csi-resizer.tmp" "$p"
    mv "$bin/csi-resizer.tmp" "$bin/csi-resizer"
  )
}

build_sanity() {
  local m; m=$(module_dir csi-sanity "github.com/kubernetes-csi/csi-test/v5 $CSI_TEST_VERSION")
  (
    cd "$m"
    [[ -f go.mod ]] || go mod init pmem-csi-tools.invalid/csi-sanity >/dev/null 2>&1
    local p=github.com/kubernetes-csi/csi-test/v5/cmd/csi-sanity
    go get "$p@$CSI_TEST_VERSION"
    timed csi-sanity go build -p 2 -trimpath -ldflags "-s -w" -o "$bin/csi-sanity.tmp" "$p"
    mv "$bin/csi-sanity.tmp" "$bin/csi-sanity"
  )
}

k8s_cmds=(kube-apiserver kube-controller-manager kube-scheduler kubectl)
if $with_kubelet; then k8s_cmds+=(kubelet kube-proxy); fi
want=(etcd "${k8s_cmds[@]}" csi-provisioner csi-resizer csi-sanity)
missing=()
for t in "${want[@]}"; do [[ -x $bin/$t ]] || missing+=("$t"); done
if [[ ${#missing[@]} -eq 0 ]]; then
  echo "tools up to date in $bin" >&2
  exit 0
fi

total_start=$SECONDS
[[ -x $bin/etcd ]] || timed "etcd (download + build)" build_etcd
for c in "${k8s_cmds[@]}"; do
  if ! [[ -x $bin/$c ]]; then
    timed "kubernetes (download + build)" build_kubernetes
    break
  fi
done
[[ -x $bin/csi-provisioner ]] || timed "csi-provisioner (download + build)" build_provisioner
[[ -x $bin/csi-resizer ]] || timed "csi-resizer (download + build)" build_resizer
[[ -x $bin/csi-sanity ]] || timed "csi-sanity (download + build)" build_sanity
echo "tools built into $bin in $((SECONDS - total_start))s" >&2
