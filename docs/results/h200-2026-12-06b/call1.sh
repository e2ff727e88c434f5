# h200-2026-12-06b call 1: the decode step's projections on every cuBLASLt algorithm (benchmarks.gemm_algos), then
# 2026-12-05e call2.sh's RL cells (table 4's rows that predate the folded norms, the in-place residual and cuBLASLt)
set -u
L=${LABEL:?commit label}
D=$OUT/call1-dates.txt
nvidia-smi --query-gpu=name,driver_version --format=csv > $D
run() { local name=$1 limit=$2; shift 2; echo "$name start $(date -u +%H:%M:%S)" >> $D; timeout $limit "$@" > $OUT/call1-$name.txt 2>&1; echo "$name rc=$? end $(date -u +%H:%M:%S)" | tee -a $D; }
# the machine's first process (nothing timed): the decode step at 256 and 64 rows
run warm 70 python -m benchmarks.decode_step --rows 256 64 --live 704 --parts step
tail -3 $OUT/call1-warm.txt | cut -c1-200
run algos 170 python -m benchmarks.gemm_algos --rows 64 128 256 --json $OUT/call1-algos.json
grep -E "^\||torch" $OUT/call1-algos.txt | cut -c1-260 | tail -30
run rl 280 python -m benchmarks.rl --cells wide-greedy,wide-sampled,longtail-64-1024-top-p,longctx --candidates auto --repeats 2 --busy off --commit-label $L --eos-scales docs/results/h200-2026-12-01/rl-scales-3b.json --json $OUT/call1-rl.json
tail -8 $OUT/call1-rl.txt | cut -c1-250
cat $D
