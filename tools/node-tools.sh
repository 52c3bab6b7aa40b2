#!/usr/bin/env bash
# Builds what a real Kubernetes node needs beside the control plane of tools/build.sh, so that the
# shipped manifests can run under a real kubelet and containerd: kubelet (by tools/build.sh, from the
# same k8s.io/kubernetes module as kube-apiserver), containerd with its runc shim and ctr, runc, the
# CNI plugins of a bridge network, and the two images a node needs without a registry (a pause image
# for the sandboxes and a busybox workload image), as OCI archives for `ctr images import`.
# Everything comes from the Go module proxy and Debian, into the per-machine cache of build.sh; each
# part is rebuilt only when its pin changes, and a lock makes concurrent callers wait for each other.
#
# usage: tools/node-tools.sh [--print-dir | --print-cni-dir | --print-images-dir | --print-images]
#   --print-dir         print the directory holding kubelet, containerd, the shim, ctr and runc
#   --print-cni-dir     print the directory holding the CNI plugins (containerd's CNI bin_dirs)
#   --print-images-dir  print the directory holding the image archives
#   --print-images      print "<archive> <image name>" per image, for `ctr -n k8s.io images import`
set -euo pipefail

CONTAINERD_VERSION=v2.4.2
# Debian's runc 1.1.5 and crun fail under containerd 2.4 on this machine.
RUNC_VERSION=v1.5.3
CNI_PLUGINS_VERSION=v1.10.0
# What a bridge pod network needs: the bridge itself, its address allocator, the pod's loopback
# interface (containerd's CRI runs this plugin unless use_internal_loopback is set) and hostPort
# mappings.
CNI_PLUGINS=(main/bridge ipam/host-local main/loopback meta/portmap)
# containerd 2.4's default sandbox image: under this name the CRI plugin finds it without a pull and
# pins it against image garbage collection, with no configuration.
PAUSE_IMAGE=registry.k8s.io/pause:3.10.2
# "localhost/" keeps CRI from normalizing the name to docker.io; pods name it with
# imagePullPolicy IfNotPresent (or Never), so nothing is pulled.
BUSYBOX_IMAGE=localhost/busybox:pmem-csi-e2e

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
cache_root=${XDG_CACHE_HOME:-$HOME/.cache}/pmem-csi/tools
dir=$cache_root/node-containerd-$CONTAINERD_VERSION.runc-$RUNC_VERSION.cni-$CNI_PLUGINS_VERSION
bin=$dir/bin
cni=$dir/cni
# The images are cheap to rebuild, so any change of their recipe (this script, pause.c) or of the
# Debian release the busybox comes from gets a new directory instead of a hand-kept pin.
# shellcheck source=/dev/null
codename=$(. /etc/os-release && echo "${VERSION_CODENAME:?no VERSION_CODENAME in /etc/os-release}")
recipe=$(cat "${BASH_SOURCE[0]}" "$here/pause.c" "$here/oci-archive.sh" | sha256sum | cut -c1-12)
images=$cache_root/node-images-$codename-$recipe
pause_archive=$images/pause.oci.tar
busybox_archive=$images/busybox.oci.tar

case ${1:-} in
  --print-dir) echo "$bin"; exit 0 ;;
  --print-cni-dir) echo "$cni"; exit 0 ;;
  --print-images-dir) echo "$images"; exit 0 ;;
  --print-images)
    echo "$pause_archive $PAUSE_IMAGE"
    echo "$busybox_archive $BUSYBOX_IMAGE"
    exit 0 ;;
  "") ;;
  *) sed -n '/^# usage:/,/^[^#]/s/^# \{0,1\}//p' "${BASH_SOURCE[0]}" >&2; exit 2 ;;
esac

if ! command -v go >/dev/null 2>&1; then
  echo "error: 'go' not found. Install Go >= 1.26 with access to a Go module proxy (Debian's golang-1.19 is too old)." >&2
  exit 1
fi
# Layers are tar archives of trees made here; a umask of 077 would make "/" unreadable to the
# pause image's non-root user.
umask 022

mkdir -p "$cache_root"
exec 8>"$cache_root/.node-lock"
flock 8

# No cgo but for runc: containerd's btrfs snapshotter is the only other part that needs it, and no
# node here uses btrfs (hence no_btrfs below).
export CGO_ENABLED=0 GOFLAGS=-mod=mod GOTOOLCHAIN=local

# shellcheck source=tools/go-module.sh
source "$here/go-module.sh"

# apt drops privileges to _apt, which cannot write into a root-owned cache; a fresh machine may
# have empty package lists, so they are updated once on failure.
apt_download() {
  local package=$1 into=$2
  (cd "$into" && { apt-get download -q -o APT::Sandbox::User=root "$package" ||
    { apt-get update -qq && apt-get download -q -o APT::Sandbox::User=root "$package"; }; })
}

build_containerd() {
  local m; m=$(module_dir containerd "github.com/containerd/containerd/v2 $CONTAINERD_VERSION")
  (
    cd "$m"
    [[ -f go.mod ]] || go mod init pmem-csi-tools.invalid/containerd >/dev/null 2>&1
    local p=github.com/containerd/containerd/v2 c
    go get "$p/cmd/containerd@$CONTAINERD_VERSION" "$p/cmd/containerd-shim-runc-v2@$CONTAINERD_VERSION" \
      "$p/cmd/ctr@$CONTAINERD_VERSION"
    for c in containerd containerd-shim-runc-v2 ctr; do
      timed "$c" go build -p 2 -trimpath -tags no_btrfs \
        -ldflags "-s -w -X $p/version.Version=$CONTAINERD_VERSION -X $p/version.Package=$p" \
        -o "$bin/$c.tmp" "$p/cmd/$c"
      mv "$bin/$c.tmp" "$bin/$c"
    done
  )
}

# runc needs cgo, for libcontainer/nsenter and for seccomp (without which a pod's default
# RuntimeDefault profile cannot be applied); static like runc's own `make static`, so the binary
# does not depend on this machine's libseccomp at run time.
ensure_libseccomp() {
  [[ -f /usr/include/seccomp.h && -f $(gcc -print-file-name=libseccomp.a) ]] && return 0
  if [[ $(id -u) -eq 0 ]] && command -v apt-get >/dev/null 2>&1; then
    echo "node-tools: installing Debian's libseccomp-dev (runc is linked statically against libseccomp)" >&2
    apt-get install -y -q libseccomp-dev >&2 || { apt-get update -qq && apt-get install -y -q libseccomp-dev >&2; }
  else
    echo "error: runc needs libseccomp's headers and static library: install libseccomp-dev" >&2
    exit 1
  fi
}

# runc is installed as its own main module, so that its go.mod and go.sum pin its dependencies as
# in its releases. Its nsenter package is cgo only: with the CGO_ENABLED=0 of the other tools,
# `go install` fails with "build constraints exclude all Go files in .../libcontainer/nsenter".
build_runc() {
  command -v gcc >/dev/null 2>&1 || { echo "error: runc needs gcc (cgo)" >&2; exit 1; }
  ensure_libseccomp
  local gobin=$dir/.gobin-runc
  rm -rf "$gobin"
  # The tags of runc's Makefile minus libpathrs (a Rust library Debian does not ship; runc then
  # uses its Go fallback), plus those and the linker flags of its `make static`.
  timed runc env CGO_ENABLED=1 GOFLAGS= GOBIN="$gobin" go install -p 2 -trimpath -buildmode=pie \
    -tags "seccomp urfave_cli_no_docs netgo osusergo" \
    -ldflags "-s -w -linkmode external -extldflags -static-pie" \
    "github.com/opencontainers/runc@$RUNC_VERSION"
  mv "$gobin/runc" "$bin/runc"
  rm -rf "$gobin"
}

build_cni() {
  local m; m=$(module_dir cni "github.com/containernetworking/plugins $CNI_PLUGINS_VERSION")
  mkdir -p "$cni"
  (
    cd "$m"
    [[ -f go.mod ]] || go mod init pmem-csi-tools.invalid/cni >/dev/null 2>&1
    local p=github.com/containernetworking/plugins plugin pkgs=()
    for plugin in "${CNI_PLUGINS[@]}"; do pkgs+=("$p/plugins/$plugin@$CNI_PLUGINS_VERSION"); done
    go get "${pkgs[@]}"
    for plugin in "${CNI_PLUGINS[@]}"; do
      local name=${plugin#*/}
      timed "$name" go build -p 2 -trimpath \
        -ldflags "-s -w -X $p/pkg/utils/buildversion.BuildVersion=$CNI_PLUGINS_VERSION" \
        -o "$cni/$name.tmp" "$p/plugins/$plugin"
      mv "$cni/$name.tmp" "$cni/$name"
    done
  )
}

# oci_archive <rootfs> <image name> <config JSON object> <archive>
# shellcheck source=tools/oci-archive.sh
source "$here/oci-archive.sh"

build_images() {
  command -v gcc >/dev/null 2>&1 || { echo "error: the pause image needs gcc" >&2; exit 1; }
  local work
  rm -rf "$images"
  mkdir -p "$images"
  work=$(mktemp -d "$images/.work.XXXXXX")

  # pause: only the sandbox binary, run as the nobody-like user of Kubernetes' own pause image.
  mkdir -p "$work/pause"
  gcc -static -Os -s -o "$work/pause/pause" "$here/pause.c"
  oci_archive "$work/pause" "$PAUSE_IMAGE" '{"Entrypoint":["/pause"],"User":"65535:65535"}' \
    "$pause_archive.tmp"
  mv "$pause_archive.tmp" "$pause_archive"

  # busybox: Debian's static busybox with a link per applet, for the e2e pods' `sleep` and the
  # examples' shell commands; downloaded and unpacked, not installed.
  mkdir -p "$work/debs" "$work/busybox/bin" "$work/busybox/tmp"
  chmod 1777 "$work/busybox/tmp"
  apt_download busybox-static "$work/debs"
  dpkg-deb -x "$work/debs"/busybox-static_*.deb "$work/unpacked"
  cp "$work/unpacked/bin/busybox" "$work/busybox/bin/busybox"
  local applet
  while read -r applet; do
    [[ $applet == bin/busybox ]] && continue
    mkdir -p "$work/busybox/$(dirname "$applet")"
    ln -sf /bin/busybox "$work/busybox/$applet"
  done < <("$work/busybox/bin/busybox" --list-full)
  oci_archive "$work/busybox" "$BUSYBOX_IMAGE" \
    '{"Env":["PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"],"Cmd":["sh"]}' \
    "$busybox_archive.tmp"
  mv "$busybox_archive.tmp" "$busybox_archive"
  rm -rf "$work"
  echo "node-tools: $PAUSE_IMAGE in $pause_archive ($(du -h "$pause_archive" | cut -f1))" >&2
  echo "node-tools: $BUSYBOX_IMAGE in $busybox_archive ($(du -h "$busybox_archive" | cut -f1))" >&2
}

total_start=$SECONDS
built=false
mkdir -p "$bin"
if ! [[ -x $bin/containerd && -x $bin/containerd-shim-runc-v2 && -x $bin/ctr ]]; then
  timed "containerd (download + build)" build_containerd; built=true
fi
if ! [[ -x $bin/runc ]]; then
  timed "runc (download + build)" build_runc; built=true
fi
for plugin in "${CNI_PLUGINS[@]}"; do
  if ! [[ -x $cni/${plugin#*/} ]]; then
    timed "cni plugins (download + build)" build_cni; built=true
    break
  fi
done
if ! [[ -f $pause_archive && -f $busybox_archive ]]; then
  timed "images" build_images; built=true
fi
# kubelet belongs to build.sh's Kubernetes pin and module; it is linked here so that one directory
# holds a node's binaries. build.sh is a no-op when kubelet is already built.
bash "$here/build.sh" --with-kubelet
ln -sfn "$(bash "$here/build.sh" --print-dir)/kubelet" "$bin/kubelet"
if $built; then
  echo "node tools built into $bin, $cni and $images in $((SECONDS - total_start))s" >&2
fi
