set -u
nvidia-smi --query-gpu=name,driver_version --format=csv > $OUT/call2-dates.txt
run() { local name=$1 limit=$2; shift 2; echo "$name start $(date -u +%H:%M:%S)" >> $OUT/call2-dates.txt; timeout $limit "$@" > $OUT/call2-$name.txt 2>&1; echo "$name rc=$? end $(date -u +%H:%M:%S)" | tee -a $OUT/call2-dates.txt; }
run rl-warm 280 python -m benchmarks.step --cells uniform --paths packed --steps 3 --out $OUT/call2-rl-warm.json
tail -12 $OUT/call2-rl-warm.txt
run rl-cold 290 env CUDA_CACHE_DISABLE=1 python -m benchmarks.step --cells uniform --paths packed --steps 3 --out $OUT/call2-rl-cold.json
tail -12 $OUT/call2-rl-cold.txt
