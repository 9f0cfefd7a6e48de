#!/usr/bin/env bash
# What CI's stage after the tests needs built: cargo-semver-checks and the rustdoc JSON of both
# sides (scripts/semver.sh --prepare). .ci/run
# starts this in the background, at the lowest CPU and I/O priority, before the test stage: the
# tests mostly wait on the broker and the database, and this takes their idle cores (about
# 25 min of CPU on 2 cores run one after the other, CI's log). Its own target directories: the
# tests hold the workspace's.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
# `setsid` (which lets .ci/run stop this whole group) puts it in a scheduler autogroup of its own
# where the kernel groups by session (sched_autogroup_enabled=1): the group's share of the CPU is
# the tests' share, and `nice -n 19` only ranks processes inside it. That is kept on purpose:
# with the group's nice at 19 as well (measured with busy loops: 2-11 % of a core against 95 %),
# a rehearsal's builds got so little CPU during the tests (the fuzz target alone 2,293 s, the
# semver tool not installed when the tests ended at 4,176 s) that CI would pass its 90 minutes
# waiting for them; at the same share they were done within the tests (stop 58).
t1=$SECONDS
bash scripts/semver.sh --prepare
echo "ci-prepare: semver tool and JSON ready ($((SECONDS - t1)) s)"
