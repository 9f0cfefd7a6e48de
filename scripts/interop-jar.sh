#!/usr/bin/env bash
# Builds the JVM interop jar (interop/jvm: the official Kafka client and the CloudEvents SDK's
# Kafka binding, one shaded jar) for the interop tests (integration-tests/tests/suite/interop.rs)
# and prints `export POSTAL_INTEROP_JAR=...`. Needs a JDK 17+ and Maven (3.8 works); the first
# build fetches the dependencies and plugins from Maven Central into ~/.m2. A jar newer than
# every source file and the pom is kept as it is.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
MODULE="$ROOT/interop/jvm"
JAR="$MODULE/target/postal-interop.jar"
command -v java >/dev/null || { echo "interop jar: no java on PATH (a JDK 17 or newer is needed)" >&2; exit 1; }
command -v mvn >/dev/null || { echo "interop jar: no mvn on PATH (Maven is needed)" >&2; exit 1; }
if [ -f "$JAR" ] && [ -z "$(find "$MODULE/pom.xml" "$MODULE/src" -newer "$JAR" -print -quit)" ]; then
  echo "interop jar: up to date ($JAR)" >&2
else
  t0=$(date +%s)
  (cd "$MODULE" && mvn -q -B -Dstyle.color=never package >&2)
  echo "interop jar: built in $(( $(date +%s) - t0 )) s ($JAR)" >&2
fi
echo "export POSTAL_INTEROP_JAR=$JAR"
