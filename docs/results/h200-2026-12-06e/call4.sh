# h200-2026-12-06e call 4 (a new session's first call; the never-run call 2 plus the tuned BLAS as a second twin):
# the fused kernel's CUDA tests; the step at 8-256 rows with the rotary inside the attention against apart at every row
# count (the threshold of kernels.rotary_in_attention_rows); the OPSD rollout cells at the defaults against the twin at
# 0 rows and the twin with kernels.blas_library='cublaslt-tuned', interleaved in one process
set -u
L=${LABEL:?commit label}
C=${CALL:-call4}
D=$OUT/$C-dates.txt
nvidia-smi --query-gpu=name,driver_version --format=csv > $D
run() { local name=$1 limit=$2; shift 2; echo "$name start $(date -u +%H:%M:%S)" >> $D; timeout $limit "$@" > $OUT/$C-$name.txt 2>&1; echo "$name rc=$? end $(date -u +%H:%M:%S)" | tee -a $D; }
# the machine's first process (nothing timed): the kernels' tests on CUDA
run tests 120 python -m pytest -q -p no:cacheprovider -rfE tests/test_rotary_attention.py tests/test_fold_norms.py tests/test_rotary_write.py
tail -3 $OUT/$C-tests.txt
run rows 130 python docs/results/h200-2026-12-06e/rotary_rows.py 8 16 24 32 48 64 128 256
grep -E "^\||H100|H200" $OUT/$C-rows.txt
run rl 260 python -m benchmarks.rl --cells opsd-uniform,opsd-longtail --candidates auto --twin "kernels.rotary_in_attention_rows=0" --twin "kernels.blas_library='cublaslt-tuned'" --repeats 2 --busy off --commit-label $L --json $OUT/$C-rl.json
grep -E "^\| [0-9a-f]{7} " $OUT/$C-rl.txt | cut -c1-250
cat $D
