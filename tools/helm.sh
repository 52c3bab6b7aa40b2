#!/usr/bin/env bash
# Builds helm from the Go module proxy at a pinned version into a per-machine cache outside the
# repository (the chart's lint and render tests run it; ~2 minutes on 2 cores with a cold Go
# build cache, a no-op when present).
#
# usage: tools/helm.sh [--print-dir]
#   --print-dir  print the directory holding helm and exit
set -euo pipefail

HELM_VERSION=v4.3.2

cache_root=${XDG_CACHE_HOME:-$HOME/.cache}/pmem-csi/tools
dir=$cache_root/helm-$HELM_VERSION

if [[ ${1:-} == --print-dir ]]; then
    echo "$dir"
    exit 0
fi

if ! command -v go >/dev/null 2>&1; then
    echo "error: 'go' not found. Install Go >= 1.26 with access to a Go module proxy." >&2
    exit 1
fi
mkdir -p "$cache_root"
exec 9>"$cache_root/.helm-lock"
flock 9
if [[ -x $dir/helm ]]; then
    exit 0
fi
rm -rf "$dir.tmp"
mkdir -p "$dir.tmp"
GOBIN=$dir.tmp GOFLAGS=-trimpath go install "helm.sh/helm/v4/cmd/helm@$HELM_VERSION"
mv "$dir.tmp" "$dir"
"$dir/helm" version --short
