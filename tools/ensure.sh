#!/usr/bin/env bash
# Installs what `just demo` and `just test` run on this machine and a fresh one lacks: the
# programs below from Debian's packages, `just` from crates.io. Go and Cargo cannot come from
# Debian (too old), so their absence is an error naming what to install. Every recipe that runs
# tests depends on `just ensure`, and .ci/run calls it too, so CI and the README cannot drift.
#
# usage: tools/ensure.sh [--dry-run] [--list]
#   --dry-run  print what is missing and what would be installed; install nothing
#   --list     print the program table ("program package" per line) and exit
#
# A program is looked up in PATH exactly as the driver and the tests will look it up: a program
# installed outside PATH is reported, not silently found.
set -euo pipefail

# program package: what the driver runs (driver/src/program.rs lists the same for its modes
# with devices, and tests/fresh_machine.rs keeps the two in step), what testenv and the tests
# run, and what the tool scripts need to fetch and unpack Debian packages.
PROGRAMS=(
    "blkid util-linux"
    "losetup util-linux"
    "wipefs util-linux"
    "unshare util-linux"
    "flock util-linux"
    "chrt util-linux"
    "nsenter util-linux"
    "mount mount"
    "umount mount"
    "mkfs.ext4 e2fsprogs"
    "mkfs.xfs xfsprogs"
    "resize2fs e2fsprogs"
    "xfs_growfs xfsprogs"
    "ip iproute2"
    "tar tar"
    "git git"
    "dpkg-deb dpkg"
    "openssl openssl"
    "curl curl"
    "python3 python3"
    "nft nftables"
    "strip binutils"
    "gcc gcc"
)
# Only on the lvm and direct modes' hosts (the QEMU guest's image carries them): listed so that
# the driver's table is covered, not installed here.
GUEST_ONLY=(
    "ndctl ndctl"
    "lvcreate lvm2"
    "lvextend lvm2"
    "lvremove lvm2"
    "lvs lvm2"
    "vgs lvm2"
    "vgcreate lvm2"
    "vgextend lvm2"
    "pvs lvm2"
)
GO_MINIMUM=1.26

dry_run=false
case ${1:-} in
    --list)
        printf '%s\n' "${PROGRAMS[@]}" "${GUEST_ONLY[@]}"
        exit 0
        ;;
    --dry-run) dry_run=true ;;
    "") ;;
    *) echo "usage: $0 [--dry-run] [--list]" >&2; exit 2 ;;
esac

# `cargo install` puts just here; a fresh shell may not have it on PATH yet.
[[ -d $HOME/.cargo/bin ]] && PATH=$HOME/.cargo/bin:$PATH

errors=()
packages=()
for entry in "${PROGRAMS[@]}"; do
    read -r program package <<<"$entry"
    if ! command -v "$program" >/dev/null 2>&1; then
        echo "ensure: $program is missing (package $package)"
        [[ " ${packages[*]} " == *" $package "* ]] || packages+=("$package")
    fi
done

# Go builds the pinned Kubernetes tools (tools/build.sh); Debian's Go is too old for them.
if ! command -v go >/dev/null 2>&1; then
    errors+=("go is missing: install Go >= $GO_MINIMUM (https://go.dev/dl/) with access to a Go module proxy")
else
    version=$(go env GOVERSION 2>/dev/null || true)
    version=${version#go}
    if [[ -z $version ]] || ! printf '%s\n%s\n' "$GO_MINIMUM" "$version" | sort -V -C; then
        errors+=("go ${version:-of unknown version} is older than $GO_MINIMUM: install Go >= $GO_MINIMUM")
    fi
fi
if ! command -v cargo >/dev/null 2>&1; then
    errors+=("cargo is missing: install Rust >= 1.90 with rustup (https://rustup.rs)")
fi
# tools/ops-tools.sh installs TypeScript and Grafana's schema with npm.
if ! command -v npm >/dev/null 2>&1; then
    echo "ensure: npm is missing (packages nodejs npm)"
    packages+=(nodejs npm)
fi
need_just=false
if ! command -v just >/dev/null 2>&1; then
    echo "ensure: just is missing (crates.io: cargo install --locked just)"
    need_just=true
fi

if $dry_run; then
    echo "ensure: would install Debian packages: ${packages[*]:-none}"
    $need_just && echo "ensure: would install just with cargo"
    for e in "${errors[@]}"; do echo "ensure: error: $e"; done
    exit 0
fi

if (( ${#errors[@]} )); then
    for e in "${errors[@]}"; do echo "ensure: error: $e" >&2; done
    exit 1
fi

if (( ${#packages[@]} )); then
    if (( EUID != 0 )); then
        echo "ensure: error: installing ${packages[*]} needs root: run as root, or: sudo apt-get install ${packages[*]}" >&2
        exit 1
    fi
    echo "ensure: installing Debian packages: ${packages[*]}"
    # A fresh machine may have empty package lists: update them once and retry.
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${packages[@]}" >/dev/null ||
        { apt-get update -qq &&
          DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${packages[@]}" >/dev/null; }
fi
if $need_just; then
    echo "ensure: installing just (cargo install --locked just, about 90 s)"
    cargo install --locked --quiet just
fi

# What was installed must now be found: a package that no longer ships the program would
# otherwise fail later, in the middle of a test, with a less clear message.
missing=()
for entry in "${PROGRAMS[@]}"; do
    read -r program package <<<"$entry"
    command -v "$program" >/dev/null 2>&1 && continue
    for dir in /usr/local/sbin /usr/sbin /sbin /usr/bin /bin; do
        if [[ -x $dir/$program ]]; then
            missing+=("$program ($package, installed in $dir, which is not on PATH: add it)")
            continue 2
        fi
    done
    missing+=("$program ($package)")
done
if (( ${#missing[@]} )); then
    echo "ensure: error: still missing after installing: ${missing[*]}" >&2
    exit 1
fi
