set -u
D=$OUT/call5-dates.txt
nvidia-smi --query-gpu=name,driver_version --format=csv > $D
run() { local name=$1 limit=$2; shift 2; echo "$name start $(date -u +%H:%M:%S)" >> $D; timeout $limit "$@" > $OUT/call5-$name.txt 2>&1; echo "$name rc=$? end $(date -u +%H:%M:%S)" | tee -a $D; }
# the machine's first process when it is a fresh one (not timed for the record)
run tests 90 python -m pytest -m gpu -q -p no:cacheprovider tests/test_fused_nucleus.py -k plain
tail -2 $OUT/call5-tests.txt
# the long-tail RL cell (T = 1, top-p 1, few live rows for most steps) with the plain draw against the compiled sampler
run rl 180 python -m benchmarks.rl --cells longtail-64-1024 --candidates auto --twin sampler.fused=False --repeats 2 --busy off --eos-scales docs/results/h200-2026-12-01/rl-scales-3b.json --json $OUT/call5-rl.json
tail -3 $OUT/call5-rl.txt
# the OPSD step's long-tail cell alone on 7fcecda (the residual in place and the plain draw)
run longtail 200 python -m benchmarks.step --cells longtail --paths packed --steps 3 --out $OUT/call5-longtail.json
tail -3 $OUT/call5-longtail.txt
cat $D
