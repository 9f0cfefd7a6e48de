#!/usr/bin/env bash
# The semver check: each published library crate's public API against the previous release
# (the commit in scripts/previous-release), with cargo-semver-checks (installed when missing,
# pinned). Exits non-zero when a change needs a bigger version bump than the workspace's
# version makes (CHANGELOG.md, Versioning).
#
# The rustdoc JSON is built here rather than by cargo-semver-checks: its own builds copy each
# crate into a workspace of its own and compile every dependency again, for each crate and each
# side (measured: 27 min 46 s for 4 of the crates on 2 loaded cores). Each side has a target
# directory of its own under target/semver/: never one for both (their workspace crates have
# the same relative paths, and cargo would take one side's for the other's), and not the
# workspace's (RUSTC_BOOTSTRAP=1, which lets the stable toolchain write rustdoc's unstable JSON,
# makes cargo check again every dependency it touches; and CI builds these while its tests run,
# which hold the workspace's target directory).
#
#   bash scripts/semver.sh            check every crate that the previous release had
#   bash scripts/semver.sh --prepare  only install the tool and build the JSON (CI, in the
#                                     background while the tests run)
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
base_src="$target/semver/base-src"
base_target="$target/semver/base"
current_target="$target/semver/current"
# The previous release's sources.
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
if [ "${1:-}" = "--prepare" ]; then
  for crate in "${crates[@]}"; do
    json "$base_src" "$base_target" "$crate" >/dev/null
    json "$ROOT" "$current_target" "$crate" >/dev/null
  done
  echo "semver: the tool and the rustdoc JSON of ${#crates[@]} crates on both sides are ready"
  exit 0
fi
failed=()
for crate in "${crates[@]}"; do
  echo "semver: $crate against ${rev:0:10}"
  base="$(json "$base_src" "$base_target" "$crate")"
  current="$(json "$ROOT" "$current_target" "$crate")"
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
