# h200-2026-12-06c call 4 (needs an H200: the 3B/3B step peaks at 90 GiB): the OPSD step's uniform and long-tail
# cells (the long-tail one at the row cap of 128) with the rollout's BLAS as the default and as cublaslt-tuned,
# interleaved in one process; then opsd-uniform alone with the same twin
set -u
L=${LABEL:?commit label}
C=${CALL:-call4}
D=$OUT/$C-dates.txt
nvidia-smi --query-gpu=name,driver_version --format=csv > $D
run() { local name=$1 limit=$2; shift 2; echo "$name start $(date -u +%H:%M:%S)" >> $D; timeout $limit "$@" > $OUT/$C-$name.txt 2>&1; echo "$name rc=$? end $(date -u +%H:%M:%S)" | tee -a $D; }
# the machine's first process (nothing timed): the tuned products' tests on CUDA
run tests 80 python -m pytest -q -p no:cacheprovider -rfE tests/test_tuned_gemm.py tests/test_blas.py
tail -1 $OUT/$C-tests.txt
run step 380 python -m benchmarks.step --cells ${CELLS:-uniform,longtail} --paths packed --steps 3 --twin "kernels.blas_library='cublaslt-tuned'" --out $OUT/$C-step.json
grep -E "^\||out of memory|Error" $OUT/$C-step.txt | cut -c1-400
[ -n "${NO_RL:-}" ] || run rl 120 python -m benchmarks.rl --cells opsd-uniform --candidates auto --twin "kernels.blas_library='cublaslt-tuned'" --repeats 2 --busy off --commit-label $L --json $OUT/$C-rl.json
[ -n "${NO_RL:-}" ] || grep -E "^\| [0-9a-f]{7} " $OUT/$C-rl.txt | cut -c1-250
cat $D
