#!/usr/bin/env bash
# One line naming the tests the last `ctest` run skipped, grouped by their reason:
#   tests/skipped_tests.sh BUILD_DIR
# A GoogleTest test gives its reason on the line after "FILE:LINE: Skipped"; a benchmark prints
# "skipped: REASON". Reads BUILD_DIR/Testing/Temporary/LastTest.log, which every ctest run writes.
set -euo pipefail
log="${1:-build}/Testing/Temporary/LastTest.log"
if [[ ! -f "$log" ]]; then
  echo "skipped tests: unknown ($log is missing: did ctest run?)"
  exit 0
fi
awk '
  function flush() {
    if (name != "" && skipped) { count[reason]++; names[reason] = names[reason] (names[reason] == "" ? "" : ", ") name; total++ }
    name = ""; skipped = 0; reason = ""; take_next = 0; bench_skip = 0
  }
  /^[0-9]+\/[0-9]+ Testing: / { flush(); name = $0; sub(/^[0-9]+\/[0-9]+ Testing: /, "", name); next }
  take_next { reason = $0; take_next = 0; next }
  /: Skipped$/ { take_next = 1; next }
  /^skipped: / { if (reason == "") { reason = $0; sub(/^skipped: /, "", reason) }; bench_skip = 1; next }
  /^Skip regular expression found in output/ { skipped = 1; next }
  /^Test Passed\.$/ { if (bench_skip) skipped = 1; bench_skip = 0; next }
  /^Test Failed\.$/ { bench_skip = 0; next }
  END {
    flush()
    if (total == 0) { print "skipped tests: 0"; exit }
    line = "skipped tests: " total
    sep = ": "
    for (r in count) { line = line sep count[r] " because " r " (" names[r] ")"; sep = "; " }
    print line
  }
' "$log"
