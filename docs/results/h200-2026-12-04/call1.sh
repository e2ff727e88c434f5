set -u
D=$OUT/call1-dates.txt
nvidia-smi --query-gpu=name,driver_version --format=csv > $D
python -c "import torch, transformers, triton; print(torch.__version__, torch.version.cuda, transformers.__version__, triton.__version__)" >> $D
run() { local name=$1 limit=$2; shift 2; echo "$name start $(date -u +%H:%M:%S)" >> $D; timeout $limit "$@" > $OUT/call1-$name.txt 2>&1; echo "$name rc=$? end $(date -u +%H:%M:%S)" | tee -a $D; }
# the machine's first process (nothing timed from it): the GPU tests of this session's rollout change
run tests 150 python -m pytest -m gpu -q -x -p no:cacheprovider tests/test_bad_inputs_rollout.py tests/test_opsd_packed.py
tail -3 $OUT/call1-tests.txt
# issue 33: light mode's cost at the step size of the earlier measurement (bbde715: 8 x 4 x 128), weights fixed
MID="--student qwen25-3b --teacher qwen25-3b --batch-size 8 --samples-per-prompt 4 --max-new-tokens 128 --prompt-len 128"
run light 400 python -m benchmarks.profiler_cost light --pairs 100 --warmup 6 --fixed-work --gc-freeze --json-out $OUT/call1-light.json -- $MID --lr 1e-30
tail -8 $OUT/call1-light.txt
cat $D
