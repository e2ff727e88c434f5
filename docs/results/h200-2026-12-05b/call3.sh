set -u
D=$OUT/call3-dates.txt
nvidia-smi --query-gpu=name,driver_version --format=csv > $D
run() { local name=$1 limit=$2; shift 2; echo "$name start $(date -u +%H:%M:%S)" >> $D; timeout $limit "$@" > $OUT/call3-$name.txt 2>&1; echo "$name rc=$? end $(date -u +%H:%M:%S)" | tee -a $D; }
# the machine's first process (nothing timed): the split-K op's tests on CUDA
run tests 40 python -m pytest -q -p no:cacheprovider -x tests/test_split_k.py
# the opsd-uniform rollout, the defaults against kernels.down_split_rows=256, interleaved
run rl 100 python -m benchmarks.rl --cells opsd-uniform --candidates auto --twin kernels.down_split_rows=256 --repeats 2 --busy off --json $OUT/call3-rl.json
tail -3 $OUT/call3-rl.txt | cut -c1-250
cat $D
