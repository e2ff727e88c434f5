set -u
D=$OUT/call3-dates.txt
nvidia-smi --query-gpu=name,driver_version --format=csv > $D
run() { local name=$1 limit=$2; shift 2; echo "$name start $(date -u +%H:%M:%S)" >> $D; timeout $limit "$@" > $OUT/call3-$name.txt 2>&1; echo "$name rc=$? end $(date -u +%H:%M:%S)" | tee -a $D; }
# the machine's first process (no separate warm-up: the device time left would not cover one): the uniform cell, then
# the long-tail cell with the uniform cell's models released (benchmarks.harness.device.release_memory)
run step 300 python -m benchmarks.step --cells uniform,longtail --paths packed --steps 2 --out $OUT/call3-step.json
tail -12 $OUT/call3-step.txt | cut -c1-230
cat $D
