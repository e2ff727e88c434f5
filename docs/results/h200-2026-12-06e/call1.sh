# h200-2026-12-06e call 1: the rotary and cache write inside the decode attention kernel (kernels.rotary_in_attention)
# against the rotary kernel before it: CUDA tests, the decode step A/B at 256/128/64/8 rows, the two steps' kernels at
# 256 and 8 rows, and the OPSD rollout cells with the twin interleaved
set -u
L=${LABEL:?commit label}
C=${CALL:-call1}
D=$OUT/$C-dates.txt
T="kernels.rotary_in_attention=False"
nvidia-smi --query-gpu=name,driver_version --format=csv > $D
run() { local name=$1 limit=$2; shift 2; echo "$name start $(date -u +%H:%M:%S)" >> $D; timeout $limit "$@" > $OUT/$C-$name.txt 2>&1; echo "$name rc=$? end $(date -u +%H:%M:%S)" | tee -a $D; }
# the machine's first process (nothing timed): the kernels' tests on CUDA
run tests 150 python -m pytest -q -p no:cacheprovider -rfE tests/test_rotary_attention.py tests/test_fold_norms.py tests/test_rotary_write.py
tail -3 $OUT/$C-tests.txt
run step 150 python -m benchmarks.decode_step --rows 256 128 64 8 --live 704 --parts step --rotary-in-attention --json $OUT/$C-step.json
grep -E "^\|" $OUT/$C-step.txt | cut -c1-300
for v in default rotary-apart; do
  run kernels-$v 90 python -m benchmarks.decode_step --rows 256 8 --live 704 --parts sampler --kernels --kernel-variant $v
  grep -E "decode_attention|rotary|Self CUDA time total|^## kernels" $OUT/$C-kernels-$v.txt | cut -c1-200
done
run rl 200 python -m benchmarks.rl --cells opsd-uniform,opsd-longtail --candidates auto --twin "$T" --repeats 2 --busy off --commit-label $L --json $OUT/$C-rl.json
grep -E "^\| [0-9a-f]{7} " $OUT/$C-rl.txt | cut -c1-250
cat $D
