#!/usr/bin/env bash
# Fetches the tools the deployment tests run, into a per-machine cache outside the repository:
# Prometheus and promtool (Debian's prometheus), shellcheck and buildah (with the containers-common
# files and the libgpgme it links against) from this machine's Debian release, unpacked without
# installing; TypeScript and Grafana's schema package from npm at pinned versions.
#
# usage: tools/ops-tools.sh [--print-dir]
#   --print-dir  print the directory holding the tools and exit
set -euo pipefail

TYPESCRIPT_VERSION=5.9.3
GRAFANA_SCHEMA_VERSION=13.2.3
DEBIAN_PACKAGES=(prometheus shellcheck buildah golang-github-containers-common libgpgme11)

# shellcheck source=/dev/null
codename=$(. /etc/os-release && echo "${VERSION_CODENAME:?no VERSION_CODENAME in /etc/os-release}")
cache_root=${XDG_CACHE_HOME:-$HOME/.cache}/pmem-csi/tools
dir=$cache_root/ops-$codename.ts-$TYPESCRIPT_VERSION.grafana-schema-$GRAFANA_SCHEMA_VERSION

if [[ ${1:-} == --print-dir ]]; then
    echo "$dir"
    exit 0
fi

mkdir -p "$cache_root"
exec 9>"$cache_root/.ops-lock"
flock 9

if [[ -x $dir/bin/promtool && -x $dir/bin/shellcheck && -x $dir/bin/buildah &&
      -x $dir/npm/node_modules/.bin/tsc ]]; then
    exit 0
fi
rm -rf "$dir"
mkdir -p "$dir/debs" "$dir/bin"
for package in "${DEBIAN_PACKAGES[@]}"; do
    # apt drops privileges to _apt, which cannot write into a root-owned cache.
    # A fresh machine may have empty package lists: update them once and retry.
    (cd "$dir/debs" && { apt-get download -q -o APT::Sandbox::User=root "$package" ||
        { apt-get update -qq && apt-get download -q -o APT::Sandbox::User=root "$package"; }; })
    debs=("$dir/debs/${package}"_*.deb)
    dpkg-deb -x "${debs[-1]}" "$dir/unpacked"
done
for tool in prometheus promtool shellcheck; do
    ln -s "../unpacked/usr/bin/$tool" "$dir/bin/$tool"
done
# buildah finds the unpacked libgpgme through the library path; its signature policy
# (accept anything: the image is built from local files only) travels with it.
libgpgme=$(find "$dir/unpacked" -name 'libgpgme.so.11' -print -quit)
[[ -n $libgpgme ]] || { echo "ops-tools: libgpgme.so.11 not in libgpgme11" >&2; exit 1; }
cat >"$dir/bin/buildah" <<WRAPPER
#!/bin/sh
LD_LIBRARY_PATH='$(dirname "$libgpgme")'\${LD_LIBRARY_PATH:+:\$LD_LIBRARY_PATH} exec '$dir/unpacked/usr/bin/buildah' "\$@"
WRAPPER
chmod 0755 "$dir/bin/buildah"
mkdir -p "$dir/npm"
(cd "$dir/npm" && npm install --no-audit --no-fund --silent \
    "typescript@$TYPESCRIPT_VERSION" "@grafana/schema@$GRAFANA_SCHEMA_VERSION")
"$dir/bin/promtool" --version | head -1
"$dir/bin/shellcheck" --version | sed -n 2p
"$dir/bin/buildah" --version
"$dir/npm/node_modules/.bin/tsc" --version
