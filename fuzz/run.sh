#!/bin/sh
# Run one fuzz target for SECONDS: fuzz/run.sh TARGET SECONDS [libFuzzer args...]
# Its corpus grows in fuzz/corpus/TARGET (seeds from fuzz/seeds/TARGET);
# the whole log goes to fuzz/target/TARGET.log; a crash prints the
# fuzzer's report (the panic, the input) and fails.
set -u
t=$1; secs=$2; shift 2
cd "$(dirname "$0")" || exit 2
mkdir -p "corpus/$t" target
seeds=""
[ -d "seeds/$t" ] && seeds="seeds/$t"
dict=""
[ -f "$t.dict" ] && dict="-dict=$t.dict"
# A target's own libFuzzer flags, one per line (see the file for why).
args=""
[ -f "$t.args" ] && args=$(grep -v '^#' "$t.args")
log="target/$t.log"
RUSTC_BOOTSTRAP=1 cargo fuzz run "$t" "corpus/$t" $seeds -- \
  -max_total_time="$secs" -print_final_stats=1 $dict $args "$@" >"$log" 2>&1
rc=$?
if [ $rc -ne 0 ]; then
  echo "fuzz target $t FAILED (exit $rc); the end of $PWD/$log:"
  tail -n 80 "$log"
  exit 1
fi
echo "fuzz target $t: $(grep -E '^stat::number_of_executed_units' "$log" | awk '{print $2}') executions in ${secs} s, no crash"
