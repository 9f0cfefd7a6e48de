#!/usr/bin/env bash
# The semver check: each published library crate's public API against the previous release
# (the commit in scripts/previous-release), with cargo-semver-checks (installed when missing,
# pinned). Exits non-zero when a change needs a bigger version bump than the workspace's
# version makes (CHANGELOG.md, Versioning).
#
# The rustdoc JSON is built here rather than by cargo-semver-checks: its own builds copy each
# crate into a workspace of its own and compile every dependency again, for each crate and each
# side (measured: 27 min 46 s for 4 of the crates on 2 loaded cores). Here the current side
# uses the workspace's target directory, and the previous release's side the target directory
# of its build (scripts/previous-release.sh). RUSTC_BOOTSTRAP=1 makes cargo check again the
# dependencies it touches (CI runs this stage last). Never one directory
# for both: their workspace crates have the same relative paths, and cargo would take one
# side's for the other's. rustdoc's JSON output is unstable: RUSTC_BOOTSTRAP=1 lets the
# stable toolchain write it.
#
#   bash scripts/semver.sh            check every crate that the previous release had
#   SEMVER_CRATES="postal-shared" …   only these
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
VERSION=0.51.0
TOOLS="${POSTAL_TOOLS_DIR:-$ROOT/target/tools}"
export PATH="$TOOLS/bin:$PATH"
if [ "$(cargo-semver-checks --version 2>/dev/null || true)" != "cargo-semver-checks $VERSION" ]; then
  echo "semver: installing cargo-semver-checks $VERSION into $TOOLS (a few minutes, once)"
  cargo install -q cargo-semver-checks --version "$VERSION" --locked --root "$TOOLS" \
    --target-dir "$TOOLS/build"
  rm -rf "$TOOLS/build"
fi

rev="$(grep -v '^#' scripts/previous-release | head -1)"
target="${CARGO_TARGET_DIR:-$ROOT/target}"
base_src="$target/previous-release/src"
base_target="$target/previous-release/target"
# The previous release's sources, as scripts/previous-release.sh extracts them.
if [ "$(cat "$base_src/.rev" 2>/dev/null || true)" != "$rev" ]; then
  rm -rf "$base_src" && mkdir -p "$base_src"
  git archive "$rev" | tar -x -C "$base_src"
  echo "$rev" > "$base_src/.rev"
fi

# The library crates the previous release published (postal-cli is a binary; postal-admin and
# the facade postal-outbox are new since).
crates=(${SEMVER_CRATES:-postal-shared postal-producer postal-consumer postal-macros postal-ops})
json() { # <workspace dir> <target dir> <crate> -> path of its rustdoc JSON
  (cd "$1" && RUSTC_BOOTSTRAP=1 CARGO_TARGET_DIR="$2" cargo rustdoc -q --locked -p "$3" --lib \
    -- -Z unstable-options --output-format json) >&2
  echo "$2/doc/${3//-/_}.json"
}
failed=()
for crate in "${crates[@]}"; do
  echo "semver: $crate against ${rev:0:10}"
  base="$(json "$base_src" "$base_target" "$crate")"
  current="$(json "$ROOT" "$target" "$crate")"
  if ! cargo-semver-checks semver-checks check-release --baseline-rustdoc "$base" \
    --current-rustdoc "$current"; then
    failed+=("$crate")
  fi
done
if [ "${#failed[@]}" -gt 0 ]; then
  echo "semver: ${failed[*]}: the API changed more than the version bump allows; bump the version (CHANGELOG.md, Versioning) or keep the old API" >&2
  exit 1
fi
echo "semver: ${#crates[@]} crates checked against ${rev:0:10}: the version bump covers every change"
