# h200-2026-12-06f call 1 (needs an H200: the 3B/3B step peaks at 90 GiB): in the machine's first process the CUDA
# tests of the fused rotary, the folded norms' fold test and the tuned BLAS (nothing timed); then the OPSD rollout
# cells at the defaults against the rotary apart (=0) and the tuned BLAS (06e call 8's command), and in what is left
# of the call's 590 s (TOTAL) the OPSD step's uniform cell with the rollout's BLAS as the default and as cublaslt-tuned
# TESTS and TEST_LIMIT shorten the first process where little device time is left
set -u
L=${LABEL:?commit label}
C=${CALL:-call1}
D=$OUT/$C-dates.txt
S=$(date +%s)
nvidia-smi --query-gpu=name,driver_version --format=csv > $D
run() { local name=$1 limit=$2; shift 2; echo "$name start $(date -u +%H:%M:%S)" >> $D; timeout $limit "$@" > $OUT/$C-$name.txt 2>&1; echo "$name rc=$? end $(date -u +%H:%M:%S)" | tee -a $D; }
run tests ${TEST_LIMIT:-110} python -m pytest -q -p no:cacheprovider -rfE ${TESTS:-tests/test_gpu_rl.py::test_fold_norms_gives_the_same_tokens_fp32 tests/test_rotary_attention.py tests/test_rotary_write.py tests/test_tuned_gemm.py tests/test_blas.py}
tail -2 $OUT/$C-tests.txt
run rl 210 python -m benchmarks.rl --cells opsd-uniform,opsd-longtail --candidates auto --twin "kernels.rotary_in_attention_rows=0" --twin "kernels.blas_library='cublaslt-tuned'" --repeats 2 --busy off --commit-label $L --json $OUT/$C-rl.json
grep -E "^\| [0-9a-f]{7} " $OUT/$C-rl.txt | cut -c1-250
LEFT=$(( ${TOTAL:-590} - ($(date +%s) - S) ))
if [ $LEFT -gt 120 ] && nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; then
run step $LEFT python -m benchmarks.step --cells uniform --paths packed --steps 3 --twin "kernels.blas_library='cublaslt-tuned'" --out $OUT/$C-step.json
grep -E "^\||out of memory|Error" $OUT/$C-step.txt | cut -c1-400
fi
cat $D
