# h200-2026-12-06b call 1: cuBLASLt's other algorithms for the decode step's projections. benchmarks.gemm_algos (every
# heuristic candidate and split-K variant, 36 layers in a graph), then kernels.blas_library="cublaslt-tuned"
# (rollout.ops.tuned_gemm) against "cublaslt" in the decode step and in RL cells, interleaved
set -u
L=${LABEL:?commit label}
D=$OUT/call1-dates.txt
nvidia-smi --query-gpu=name,driver_version --format=csv > $D
run() { local name=$1 limit=$2; shift 2; echo "$name start $(date -u +%H:%M:%S)" >> $D; timeout $limit "$@" > $OUT/call1-$name.txt 2>&1; echo "$name rc=$? end $(date -u +%H:%M:%S)" | tee -a $D; }
# the machine's first process (nothing timed): the tuned products' tests on CUDA
run tests 80 python -m pytest -q -p no:cacheprovider -rfE tests/test_tuned_gemm.py tests/test_blas.py
tail -3 $OUT/call1-tests.txt
run algos 150 python -m benchmarks.gemm_algos --rows 64 128 256 --json $OUT/call1-algos.json
grep -E "^\||torch" $OUT/call1-algos.txt | cut -c1-300 | tail -30
run step 90 python -m benchmarks.decode_step --rows 256 128 64 --live 704 --parts step --blas cublaslt cublaslt-tuned
grep -E "^\||rows" $OUT/call1-step.txt | cut -c1-200 | tail -16
run rl 170 python -m benchmarks.rl --cells opsd-uniform,longtail-64-1024 --candidates auto --twin "kernels.blas_library='cublaslt-tuned'" --repeats 2 --busy off --commit-label $L --eos-scales docs/results/h200-2026-12-01/rl-scales-3b.json --json $OUT/call1-rl.json
tail -6 $OUT/call1-rl.txt | cut -c1-250
cat $D
