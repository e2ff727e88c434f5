# h200-2026-12-06b call 2 (its second run, after the graph-pool fix; call 3: CALL=call3 on an H200): TunedGemm choosing by a CUDA graph over stand-ins for the weight (call 1 timed one launch
# after an L2 flush, and its picks lost in opsd-uniform on the H100); then, on an H200, table 4's older cells with it
set -u
L=${LABEL:?commit label}
C=${CALL:-call2}
D=$OUT/$C-dates.txt
nvidia-smi --query-gpu=name,driver_version --format=csv > $D
run() { local name=$1 limit=$2; shift 2; echo "$name start $(date -u +%H:%M:%S)" >> $D; timeout $limit "$@" > $OUT/$C-$name.txt 2>&1; echo "$name rc=$? end $(date -u +%H:%M:%S)" | tee -a $D; }
T="kernels.blas_library='cublaslt-tuned'"
# the machine's first process (nothing timed): the tuned products' tests on CUDA
run tests 80 python -m pytest -q -p no:cacheprovider -rfE tests/test_tuned_gemm.py tests/test_blas.py
tail -3 $OUT/$C-tests.txt
run algos 100 python -m benchmarks.gemm_algos --rows 64 128 256 --json $OUT/$C-algos.json
grep -E "^\|" $OUT/$C-algos.txt | cut -d'|' -f2-6,11-12 | tail -14
run step 70 python -m benchmarks.decode_step --rows 256 128 64 --live 704 --parts step --blas cublaslt cublaslt-tuned
grep -E "^\||cublaslt-tuned," $OUT/$C-step.txt | sed -E 's/compiled \+ fused.*norms folded; //' | tail -30
run rl 150 python -m benchmarks.rl --cells opsd-uniform,longtail-64-1024 --candidates auto --twin "$T" --repeats 2 --busy off --commit-label $L --eos-scales docs/results/h200-2026-12-01/rl-scales-3b.json --json $OUT/$C-rl.json
grep -E "^\| [0-9a-f]{7} |cublaslt-tuned," $OUT/$C-rl.txt | cut -c1-250
if nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; then
run rlold 170 python -m benchmarks.rl --cells wide-greedy,wide-sampled,longtail-64-1024-top-p,longctx --candidates auto --twin "$T" --repeats 2 --busy off --commit-label $L --eos-scales docs/results/h200-2026-12-01/rl-scales-3b.json --json $OUT/$C-rlold.json
grep -E "^\| [0-9a-f]{7} |cublaslt-tuned," $OUT/$C-rlold.txt | cut -c1-250
fi
cat $D
