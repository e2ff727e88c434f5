set -u
D=$OUT/call2-dates.txt
nvidia-smi --query-gpu=name,driver_version --format=csv > $D
run() { local name=$1 limit=$2; shift 2; echo "$name start $(date -u +%H:%M:%S)" >> $D; timeout $limit "$@" > $OUT/call2-$name.txt 2>&1; echo "$name rc=$? end $(date -u +%H:%M:%S)" | tee -a $D; }
# the machine's first process (nothing timed): the folded norms' tests on CUDA (kernels compiled) and in captured graphs
run tests 200 python -m pytest -q -p no:cacheprovider -rfE tests/test_fold_norms.py tests/test_gpu_rl.py::test_fold_norms_gives_the_same_tokens_fp32 tests/test_gpu_rl.py::test_residual_in_place_gives_the_same_tokens_fp32 tests/test_instrumentation_light.py::test_timers_mode_on_cuda_writes_gpu_ms_every_step_and_reuses_events
tail -3 $OUT/call2-tests.txt
# the step A/B at the uniform cell's mean width (default, folded, folded, default) and the folded step's kernels
run step256 150 python -m benchmarks.decode_step --rows 256 --live 704 --parts step --fold-norms --kernels --kernel-variant folded-norms --json $OUT/call2-step256.json
grep -E "^\| 256 " $OUT/call2-step256.txt | cut -c1-200
# the same A/B at the long-tail cell's narrower batches
run steprows 200 python -m benchmarks.decode_step --rows 8 32 64 128 --live 704 --parts step --fold-norms --json $OUT/call2-steprows.json
grep -E "^\| [0-9]+ " $OUT/call2-steprows.txt | cut -c1-200
# RL cells, the default against kernels.fold_norms=True, interleaved (the same tokens are checked by the harness)
run rl 150 python -m benchmarks.rl --cells opsd-uniform --candidates auto --twin kernels.fold_norms=True --repeats 2 --busy off --json $OUT/call2-rl.json
tail -4 $OUT/call2-rl.txt
run rllong 150 python -m benchmarks.rl --cells longtail-64-1024 --candidates auto --twin kernels.fold_norms=True --repeats 2 --busy off --eos-scales docs/results/h200-2026-12-01/rl-scales-3b.json --json $OUT/call2-rllong.json
tail -4 $OUT/call2-rllong.txt
cat $D
