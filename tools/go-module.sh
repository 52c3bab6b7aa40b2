# shellcheck shell=bash
# Sourced by tools/build.sh and tools/node-tools.sh: the build module of one Go tool in the cache,
# and the per-tool timer whose "time:" lines the cold-build figures of docs/testing.md come from.
#
# module_dir <name> <pinned module and version>: prints $dir/mod-<name>, seeded from the committed
# tools/<name>/go.{mod,sum} ($here) when they require the pin, so that a cold build resolves
# exactly what was resolved before; otherwise the caller creates the module afresh and the new
# files are worth committing.
# shellcheck disable=SC2154 # $here and $dir are the sourcing script's.
module_dir() {
  local name=$1 pinned=$2 m=$dir/mod-$1
  mkdir -p "$m"
  if [[ -f $here/$name/go.mod ]] && grep -qF "$pinned" "$here/$name/go.mod"; then
    cp "$here/$name/go.mod" "$m/go.mod"
    [[ -f $here/$name/go.sum ]] && cp "$here/$name/go.sum" "$m/go.sum"
  fi
  echo "$m"
}

# timed <name> <command…>: runs the command and prints its wall time.
timed() {
  local name=$1; shift
  local start=$SECONDS
  "$@"
  echo "time: $name $((SECONDS - start))s" >&2
}
