#!/usr/bin/env bash
# Builds the pmem-csi image as an OCI archive without a Docker engine:
#   image-oci.sh <buildah> <context directory holding rootfs/> <archive> [<image name>]
# Debian's buildah (tools/ops-tools.sh unpacks it) runs the repository's Dockerfile over the tree
# tools/image-rootfs.sh assembled. The Dockerfile only copies, so no container runtime runs; the
# image store is a throw-away vfs store beside the archive, so nothing outside it changes.
set -euo pipefail

usage="usage: image-oci.sh <buildah> <context directory> <archive> [<image name>]"
buildah=${1:?$usage}
context=${2:?$usage}
archive=${3:?$usage}
name=${4:-localhost/pmem-csi:dev}
repo=$(cd "$(dirname "$0")/.." && pwd)

[[ -d $context/rootfs ]] || { echo "image-oci: $context/rootfs missing (run image-rootfs.sh first)" >&2; exit 1; }
policy=$(dirname "$(dirname "$(readlink -f "$buildah")")")/unpacked/etc/containers/policy.json
[[ -f $policy ]] || policy=/etc/containers/policy.json
[[ -f $policy ]] || { echo "image-oci: no containers signature policy ($policy)" >&2; exit 1; }

store=$(mktemp -d "$(dirname "$archive")/.buildah-store.XXXXXX")
trap 'rm -rf "$store"' EXIT
run() {
    "$buildah" --root "$store/root" --runroot "$store/run" --storage-driver vfs "$@"
}
run bud --quiet --signature-policy "$policy" --format oci --file "$repo/Dockerfile" \
    --tag "$name" "$context" >/dev/null
rm -f "$archive"
run push --quiet --signature-policy "$policy" "$name" "oci-archive:$archive:$name"
echo "image-oci: $name in $archive ($(du -h "$archive" | cut -f1))"
