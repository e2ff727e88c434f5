# h200-2026-12-06e call 8 (b4cba24, the default 8; for an H200, else any card): the CUDA tests the default touches in
# the machine's first process (nothing timed), then the OPSD rollout cells at the defaults against the rotary apart
# (=0) and the tuned BLAS, interleaved
set -u
L=${LABEL:?commit label}
C=${CALL:-call8}
D=$OUT/$C-dates.txt
nvidia-smi --query-gpu=name,driver_version --format=csv > $D
run() { local name=$1 limit=$2; shift 2; echo "$name start $(date -u +%H:%M:%S)" >> $D; timeout $limit "$@" > $OUT/$C-$name.txt 2>&1; echo "$name rc=$? end $(date -u +%H:%M:%S)" | tee -a $D; }
run tests 170 python -m pytest -q -p no:cacheprovider -rfE tests/test_gpu_rl.py::test_fold_norms_gives_the_same_tokens_fp32 tests/test_rotary_attention.py tests/test_rotary_write.py
tail -2 $OUT/$C-tests.txt
run rl 200 python -m benchmarks.rl --cells opsd-uniform,opsd-longtail --candidates auto --twin "kernels.rotary_in_attention_rows=0" --twin "kernels.blas_library='cublaslt-tuned'" --repeats 2 --busy off --commit-label $L --json $OUT/$C-rl.json
grep -E "^\| [0-9a-f]{7} " $OUT/$C-rl.txt | cut -c1-250
cat $D
