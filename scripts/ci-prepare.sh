#!/usr/bin/env bash
# What CI's stages after the tests need built: the fuzz target (scripts/fuzz.sh --build),
# cargo-semver-checks and the rustdoc JSON of both sides (scripts/semver.sh --prepare). .ci/run
# starts this in the background, at the lowest CPU and I/O priority, before the test stage: the
# tests mostly wait on the broker and the database, and this takes their idle cores (about
# 25 min of CPU on 2 cores run one after the other, CI's log). Its own target directories: the
# tests hold the workspace's.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
t0=$SECONDS
bash scripts/fuzz.sh --build
echo "ci-prepare: fuzz target built ($((SECONDS - t0)) s)"
t1=$SECONDS
bash scripts/semver.sh --prepare
echo "ci-prepare: semver tool and JSON ready ($((SECONDS - t1)) s)"
