set -u
D=$OUT/call4-dates.txt
nvidia-smi --query-gpu=name,driver_version --format=csv > $D
run() { local name=$1 limit=$2; shift 2; echo "$name start $(date -u +%H:%M:%S)" >> $D; timeout $limit "$@" > $OUT/call4-$name.txt 2>&1; echo "$name rc=$? end $(date -u +%H:%M:%S)" | tee -a $D; }
# the machine's first process (not timed for the record): the sampler's GPU tests (the plain draw in a CUDA graph at
# the 3B vocabulary against the compiled sampler) and the routes' GPU tests (seeded samples identical across routes)
run tests 200 python -m pytest -m gpu -q -p no:cacheprovider tests/test_fused_nucleus.py tests/test_gpu_rl.py
tail -3 $OUT/call4-tests.txt
# the plain draw (top-p 1) against the compiled sampler, alone, at 8, 64 and 256 rows
run sampler 150 python -m benchmarks.sampler --rows 8 64 256 --cases T=1 --iters 30 --json $OUT/call4-sampler.json
grep -E "^\| (8|64|256) " $OUT/call4-sampler.txt | cut -c1-160
# the OPSD step's rollout with the plain draw (the default now) against the compiled sampler, interleaved
run rl 200 python -m benchmarks.rl --cells opsd-uniform --candidates auto --twin sampler.fused=False --repeats 2 --busy off --json $OUT/call4-rl.json
tail -3 $OUT/call4-rl.txt
cat $D
