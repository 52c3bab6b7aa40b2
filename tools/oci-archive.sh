# shellcheck shell=bash
# Sourced by tools/node-tools.sh and tools/real-nodes.sh.
# Writes an OCI image layout archive of one tree by hand rather than with buildah: one layer, a
# fixed mtime, owner and order make the archive depend only on the tree, and no image store or
# signature policy is involved.
#   oci_archive <rootfs> <image name> <config JSON object> <archive>
oci_archive() {
  local root=$1 name=$2 config=$3 archive=$4 arch layout digest diff_id
  local config_digest config_size layer_digest layer_size manifest_digest manifest_size
  arch=$(dpkg --print-architecture)
  layout=$(mktemp -d "$archive.layout.XXXXXX")
  mkdir -p "$layout/blobs/sha256"
  blob() {
    digest=$(sha256sum "$1" | cut -d' ' -f1)
    mv "$1" "$layout/blobs/sha256/$digest"
  }
  chmod 0755 "$root"
  tar --sort=name --mtime=@0 --owner=0 --group=0 --numeric-owner -C "$root" -cf "$layout/layer" .
  diff_id=$(sha256sum "$layout/layer" | cut -d' ' -f1)
  gzip -n -9 "$layout/layer"
  layer_size=$(stat -c %s "$layout/layer.gz")
  blob "$layout/layer.gz"; layer_digest=$digest
  printf '{"architecture":"%s","os":"linux","config":%s,"rootfs":{"type":"layers","diff_ids":["sha256:%s"]}}' \
    "$arch" "$config" "$diff_id" >"$layout/config"
  config_size=$(stat -c %s "$layout/config")
  blob "$layout/config"; config_digest=$digest
  printf '{"schemaVersion":2,"mediaType":"application/vnd.oci.image.manifest.v1+json","config":{"mediaType":"application/vnd.oci.image.config.v1+json","digest":"sha256:%s","size":%s},"layers":[{"mediaType":"application/vnd.oci.image.layer.v1.tar+gzip","digest":"sha256:%s","size":%s}]}' \
    "$config_digest" "$config_size" "$layer_digest" "$layer_size" >"$layout/manifest"
  manifest_size=$(stat -c %s "$layout/manifest")
  blob "$layout/manifest"; manifest_digest=$digest
  # containerd names an imported image after io.containerd.image.name; other tools read the OCI
  # ref.name, which buildah (tools/image-oci.sh) also sets to the full name.
  printf '{"schemaVersion":2,"mediaType":"application/vnd.oci.image.index.v1+json","manifests":[{"mediaType":"application/vnd.oci.image.manifest.v1+json","digest":"sha256:%s","size":%s,"platform":{"architecture":"%s","os":"linux"},"annotations":{"io.containerd.image.name":"%s","org.opencontainers.image.ref.name":"%s"}}]}' \
    "$manifest_digest" "$manifest_size" "$arch" "$name" "$name" >"$layout/index.json"
  echo '{"imageLayoutVersion":"1.0.0"}' >"$layout/oci-layout"
  tar --sort=name --mtime=@0 --owner=0 --group=0 --numeric-owner -C "$layout" -cf "$archive" \
    oci-layout index.json blobs
  rm -rf "$layout"
}
