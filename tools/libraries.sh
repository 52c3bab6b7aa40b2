# shellcheck shell=bash
# Sourced by tools/image-rootfs.sh and tools/real-nodes.sh.
# Copies the shared libraries and loader that a binary needs into an image tree, searching the
# tree first: a library the host happens to have is not proof the image has it (a fresh machine
# showed libcrypto.so.3, needed by libkmod through libndctl, left out). A library found nowhere
# stops the build instead of shipping an image whose programs cannot start.
#   copy_libraries <binary> <tree>
copy_libraries() {
  local binary=$1 tree=$2 listing lib
  listing=$(LD_LIBRARY_PATH=$tree/lib/x86_64-linux-gnu:$tree/usr/lib/x86_64-linux-gnu ldd "$binary")
  if grep -q 'not found' <<<"$listing"; then
    echo "$binary needs libraries neither $tree nor this host provides:" >&2
    grep 'not found' <<<"$listing" >&2
    return 1
  fi
  awk '/=> \// { print $3 } /^\t\/[^ ]+ \(/ { print $1 }' <<<"$listing" | while read -r lib; do
    # Resolved inside the tree: already there.
    [[ $lib == "$tree"/* ]] && continue
    [[ -e $tree$lib ]] || cp -L --parents "$lib" "$tree"
  done
}
