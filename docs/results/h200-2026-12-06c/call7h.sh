# h200-2026-12-06c call 7h (an H100: no H200 came): the tuned BLAS's twin on table 4's other cells
set -u
L=${LABEL:?commit label}
C=${CALL:-call7h}
D=$OUT/$C-dates.txt
nvidia-smi --query-gpu=name,driver_version --format=csv > $D
run() { local name=$1 limit=$2; shift 2; echo "$name start $(date -u +%H:%M:%S)" >> $D; timeout $limit "$@" > $OUT/$C-$name.txt 2>&1; echo "$name rc=$? end $(date -u +%H:%M:%S)" | tee -a $D; }
T="kernels.blas_library='cublaslt-tuned'"
# the machine's first process (nothing timed)
run tests 80 python -m pytest -q -p no:cacheprovider -rfE tests/test_tuned_gemm.py tests/test_blas.py tests/test_call_stats.py
tail -1 $OUT/$C-tests.txt
run rlold 270 python -m benchmarks.rl --cells wide-greedy,wide-sampled,longtail-64-1024-top-p,longctx --candidates auto --twin "$T" --repeats 2 --busy off --commit-label $L --eos-scales docs/results/h200-2026-12-01/rl-scales-3b.json --json $OUT/$C-rlold.json
grep -E "^\| [0-9a-f]{7} " $OUT/$C-rlold.txt | cut -c1-250
cat $D
