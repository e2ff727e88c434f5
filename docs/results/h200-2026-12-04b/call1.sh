set -u
D=$OUT/call1-dates.txt
nvidia-smi --query-gpu=name,driver_version --format=csv > $D
run() { local name=$1 limit=$2; shift 2; echo "$name start $(date -u +%H:%M:%S)" >> $D; timeout $limit "$@" > $OUT/call1-$name.txt 2>&1; echo "$name rc=$? end $(date -u +%H:%M:%S)" | tee -a $D; }
# the machine's first process (not timed for the record): the GPU tests of the in-place residual and the attention
run tests 150 python -m pytest -m gpu -q -x -p no:cacheprovider tests/test_gpu_rl.py -k residual tests/test_decode_attention.py
tail -3 $OUT/call1-tests.txt
# the OPSD step's rollout alone (cell opsd-uniform), the default against kernels.residual_in_place=True, interleaved
run rl 210 python -m benchmarks.rl --cells opsd-uniform --candidates auto --twin kernels.residual_in_place=True --repeats 2 --busy off --json $OUT/call1-rl.json
tail -4 $OUT/call1-rl.txt
# the attention's launch parameters at the uniform cell's mean width (256 rows, 704 columns) and half of it
run attention 100 python -m benchmarks.decode_step --rows 256 128 --live 704 --parts attention --json $OUT/call1-attention.json
grep -E "^\| (256|128) " $OUT/call1-attention.txt | cut -c1-150
# the step A/B and the in-place step's kernels at 256 rows
run step 120 python -m benchmarks.decode_step --rows 256 --live 704 --parts step --residual-in-place --kernels --kernel-variant residual-in-place --json $OUT/call1-step.json
grep -E "^\| 256 " $OUT/call1-step.txt | cut -c1-150
cat $D
