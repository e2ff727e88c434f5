# h200-2026-12-06c call 5 (after call 4 on the same machine, so not its first process): the candidates, the decode
# step and the RL cells with the rollout's BLAS as the default and as cublaslt-tuned (PyTorch's product among the
# candidates since c6503e4)
set -u
L=${LABEL:?commit label}
C=${CALL:-call5}
D=$OUT/$C-dates.txt
nvidia-smi --query-gpu=name,driver_version --format=csv > $D
run() { local name=$1 limit=$2; shift 2; echo "$name start $(date -u +%H:%M:%S)" >> $D; timeout $limit "$@" > $OUT/$C-$name.txt 2>&1; echo "$name rc=$? end $(date -u +%H:%M:%S)" | tee -a $D; }
T="kernels.blas_library='cublaslt-tuned'"
if [ -n "${FIRST:-}" ]; then  # a fresh machine: its first process times nothing
run tests 80 python -m pytest -q -p no:cacheprovider -rfE tests/test_tuned_gemm.py tests/test_blas.py
tail -1 $OUT/$C-tests.txt
fi
run algos 100 python -m benchmarks.gemm_algos --rows 64 128 256 --json $OUT/$C-algos.json
grep -E "^\|" $OUT/$C-algos.txt | cut -d'|' -f2-6,11-12 | tail -14
run step 70 python -m benchmarks.decode_step --rows 256 128 64 --live 704 --parts step --blas cublaslt cublaslt-tuned
grep -E "^\|" $OUT/$C-step.txt | tail -14
run rl 150 python -m benchmarks.rl --cells opsd-uniform,longtail-64-1024 --candidates auto --twin "$T" --repeats 2 --busy off --commit-label $L --eos-scales docs/results/h200-2026-12-01/rl-scales-3b.json --json $OUT/$C-rl.json
grep -E "^\| [0-9a-f]{7} " $OUT/$C-rl.txt | cut -c1-250
if [ -z "${NO_OLD:-}" ] && nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; then
run rlold 170 python -m benchmarks.rl --cells wide-greedy,wide-sampled,longtail-64-1024-top-p,longctx --candidates auto --twin "$T" --repeats 2 --busy off --commit-label $L --eos-scales docs/results/h200-2026-12-01/rl-scales-3b.json --json $OUT/$C-rlold.json
grep -E "^\| [0-9a-f]{7} " $OUT/$C-rlold.txt | cut -c1-250
fi
cat $D
