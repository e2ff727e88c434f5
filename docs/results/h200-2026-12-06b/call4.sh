# h200-2026-12-06b call 4 (H200 only, short: little device time left): kernels.blas_library="cublaslt-tuned" against
# "cublaslt" in the decode step and opsd-uniform, interleaved
set -u
L=${LABEL:?commit label}
D=$OUT/call4-dates.txt
nvidia-smi --query-gpu=name,driver_version --format=csv > $D
run() { local name=$1 limit=$2; shift 2; echo "$name start $(date -u +%H:%M:%S)" >> $D; timeout $limit "$@" > $OUT/call4-$name.txt 2>&1; echo "$name rc=$? end $(date -u +%H:%M:%S)" | tee -a $D; }
run tests 60 python -m pytest -q -p no:cacheprovider -rfE tests/test_tuned_gemm.py
tail -2 $OUT/call4-tests.txt
run step 50 python -m benchmarks.decode_step --rows 256 128 --live 704 --parts step --blas cublaslt cublaslt-tuned
grep -E "^\||cublaslt-tuned," $OUT/call4-step.txt | sed -E 's/compiled \+ fused.*norms folded; //' | tail -16
run rl 100 python -m benchmarks.rl --cells opsd-uniform --candidates auto --twin "kernels.blas_library='cublaslt-tuned'" --repeats 2 --busy off --commit-label $L --json $OUT/call4-rl.json
grep -E "^\| [0-9a-f]{7} |cublaslt-tuned," $OUT/call4-rl.txt | cut -c1-250
cat $D
