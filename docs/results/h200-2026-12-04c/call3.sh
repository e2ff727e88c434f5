set -u
D=$OUT/call3-dates.txt
nvidia-smi --query-gpu=name,driver_version --format=csv > $D
run() { local name=$1 limit=$2; shift 2; echo "$name start $(date -u +%H:%M:%S)" >> $D; timeout $limit "$@" > $OUT/call3-$name.txt 2>&1; echo "$name rc=$? end $(date -u +%H:%M:%S)" | tee -a $D; }
# the machine's first process (nothing timed): every GPU test on 2316d81 (kernels.fold_norms on by default) and the
# folded norms' own tests (not marked gpu: they run on CUDA where there is one)
run tests 420 python -m pytest -q -p no:cacheprovider -rfE -m gpu tests
tail -4 $OUT/call3-tests.txt
run foldtests 120 python -m pytest -q -p no:cacheprovider -rfE tests/test_fold_norms.py
tail -2 $OUT/call3-foldtests.txt
# the OPSD step at RL scale on the new defaults (uniform and long-tail cells, 3 timed steps each)
run step 300 python -m benchmarks.step --cells uniform,longtail --paths packed --steps 3 --out $OUT/call3-step.json
tail -30 $OUT/call3-step.txt | cut -c1-220
cat $D
