#!/usr/bin/env bash
# Builds the previous release's `postal` binary (the commit named in scripts/previous-release)
# for the previous-release test, and prints `export POSTAL_PREVIOUS_BIN=...`.
#
# Its binary goes to a target directory of its own; its intermediate artifacts to the
# workspace's (cargo's build-dir), so that the dependencies it shares with the current build
# (same version, features and profile) are not compiled again: run it after the current build
# (scripts/test.sh does). Its workspace crates have another version than the current ones, so
# other file names there; with the same version cargo could take one release's workspace crates
# for the other's (their paths inside the workspace are the same): then it builds apart. Later
# runs reuse the sources and the build.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
rev="$(grep -v '^#' scripts/previous-release | head -1)"
target="${CARGO_TARGET_DIR:-$ROOT/target}"
src="$target/previous-release/src"
out="$target/previous-release/postal"
if ! git cat-file -e "$rev^{commit}" 2>/dev/null; then
  echo "previous release $rev is not in this clone (a shallow clone?): fetch it, e.g. git fetch --unshallow" >&2
  exit 1
fi
if [ "$(cat "$src/.rev" 2>/dev/null || true)" != "$rev" ]; then
  echo "previous release: extracting $rev into $src" >&2
  rm -rf "$src"
  mkdir -p "$src"
  git archive "$rev" | tar -x -C "$src"
  echo "$rev" > "$src/.rev"
fi
version() { sed -n '/^\[workspace.package\]/,/^\[/s/^version = "\(.*\)"/\1/p' "$1/Cargo.toml" | head -1; }
build_dir="$target"
if [ "$(version "$src")" = "$(version "$ROOT")" ]; then
  echo "previous release: version $(version "$src") is the current one's: building apart" >&2
  build_dir="$target/previous-release/target"
fi
echo "previous release: building postal at ${rev:0:10} (binary in $target/previous-release/target, build directory $build_dir)" >&2
(cd "$src" && CARGO_BUILD_BUILD_DIR="$build_dir" CARGO_TARGET_DIR="$target/previous-release/target" cargo build -q --locked -p postal-cli >&2)
cp "$target/previous-release/target/debug/postal" "$out"
echo "export POSTAL_PREVIOUS_BIN=$out"
