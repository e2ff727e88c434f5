set -u
D=$OUT/call2-dates.txt
nvidia-smi --query-gpu=name,driver_version --format=csv > $D
run() { local name=$1 limit=$2; shift 2; echo "$name start $(date -u +%H:%M:%S)" >> $D; timeout $limit "$@" > $OUT/call2-$name.txt 2>&1; echo "$name rc=$? end $(date -u +%H:%M:%S)" | tee -a $D; }
# the machine's first process when it is a fresh one (not timed for the record): GPU tests of the in-place residual
run tests 90 python -m pytest -m gpu -q -x -p no:cacheprovider tests/test_gpu_rl.py -k "residual or skinny"
tail -2 $OUT/call2-tests.txt
# issue 32: the uniform and long-tail cells with kernels.residual_in_place on by default
run step 480 python -m benchmarks.step --cells uniform,longtail --paths packed --steps 3 --out $OUT/call2-step.json
tail -30 $OUT/call2-step.txt
cat $D
