# h200-2026-12-05e call 2 (the machine warmed by call 1): table 4's rows that predate the folded norms, the in-place
# residual and cuBLASLt, at 5eba8e2's defaults; seed 004's workloads with cuBLASLt (Auto only); kernels.skinny_rows at 64
set -u
D=$OUT/call2-dates.txt
nvidia-smi --query-gpu=name,driver_version --format=csv > $D
run() { local name=$1 limit=$2; shift 2; echo "$name start $(date -u +%H:%M:%S)" >> $D; timeout $limit "$@" > $OUT/call2-$name.txt 2>&1; echo "$name rc=$? end $(date -u +%H:%M:%S)" | tee -a $D; }
run rl 300 python -m benchmarks.rl --cells wide-greedy,wide-sampled,longtail-64-1024-top-p,longctx --candidates auto --repeats 2 --busy off --commit-label ${LABEL:-5eba8e2} --eos-scales docs/results/h200-2026-12-01/rl-scales-3b.json --json $OUT/call2-rl.json
tail -8 $OUT/call2-rl.txt | cut -c1-250
run seed004 120 python -m benchmarks.suites --suite seed004 --model 3b --repeats 3 --json $OUT/call2-seed004.json
tail -10 $OUT/call2-seed004.txt | cut -c1-200
run skinny 90 python -m benchmarks.decode_step --rows 64 --live 512 --parts step --skinny
tail -8 $OUT/call2-skinny.txt | cut -c1-200
cat $D
