# h200-2026-12-06d call 6h (an H100): call 1h's profiled A/B on wide-greedy, summarised with 3b6d031's
# `opsd-summarize AFTER --diff BEFORE --kernels N` (the kernels per stage whose GPU time changed most)
set -u
L=${LABEL:?commit label}
C=${CALL:-call6h}
D=$OUT/$C-dates.txt
nvidia-smi --query-gpu=name,driver_version --format=csv > $D
run() { local name=$1 limit=$2; shift 2; echo "$name start $(date -u +%H:%M:%S)" >> $D; timeout $limit "$@" > $OUT/$C-$name.txt 2>&1; echo "$name rc=$? end $(date -u +%H:%M:%S)" | tee -a $D; }
# the machine's first process (nothing timed)
run tests 80 python -m pytest -q -p no:cacheprovider -rfE tests/test_tuned_gemm.py
tail -1 $OUT/$C-tests.txt
TR=/tmp/traces
run rl 200 env OPSD_PROFILE=1 python -m benchmarks.rl --cells wide-greedy --candidates auto --twin "kernels.blas_library='cublaslt-tuned'" --repeats 3 --busy on --trace-dir $TR --commit-label $L --json $OUT/$C-rl.json
grep -E "^\| [0-9a-f]{7} " $OUT/$C-rl.txt | cut -c1-200
B=$TR/wide-greedy--auto.json; A=$(ls $TR/wide-greedy--auto_*.json)
run sum 120 python scripts/summarize_trace.py $A --diff $B --kernels 6
sed -n '/^diff (/,$p' $OUT/$C-sum.txt
run sumjson 120 python scripts/summarize_trace.py $A --diff $B --kernels 6 --format json
cat $D
