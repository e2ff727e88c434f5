# h200-2026-12-07c call 2 (needs an H200: the 3B/3B OPSD step peaks at 90 GiB). The machine's first process (nothing
# timed): the KV storage and decode attention padding tests on CUDA. Then the stride sweep (the decode attention over a
# 512-column window read from storage 512..2,624 columns wide), opsd-uniform in the two trees' alternating processes
# (new, old, then after the step old, new; SHORT=1: not the second pair) and the OPSD step's uniform cell at this tree
# (a warm-up step, one timed).
# Run from the copy of this tree, with the old tree (git archive $OLD) at ../snapold. NO_STRIDE=1: no stride sweep;
# SHARED=1: after the tests, the shared-prompt table's 256-row figures (prompts 254 and 256, 704 filled) on the
# padded storage (07f).
set -u
L=${LABEL:?commit label}
OLD=${OLD:?old tree label}
C=${CALL:-call2}
D=$OUT/$C-dates.txt
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > $D
timeout 70 python -m pytest -q -p no:cacheprovider tests/test_kv_storage.py tests/test_decode_attention.py -k "storage or padding" > $OUT/$C-tests.txt 2>&1; echo "tests rc=$? $(date -u +%H:%M:%S)" | tee -a $D
tail -1 $OUT/$C-tests.txt
if [ -n "${SHARED:-}" ]; then
  timeout 60 python -m benchmarks.decode_step --rows 256 --live 1280 --parts shared --shared-windows 254,704 256,704 \
    --json $OUT/$C-shared.json > $OUT/$C-shared.txt 2>&1; echo "shared rc=$? $(date -u +%H:%M:%S)" | tee -a $D
  grep -E "^\|" $OUT/$C-shared.txt | cut -c1-220
fi
if [ -z "${NO_STRIDE:-}" ]; then
  timeout 60 python docs/results/h200-2026-12-07b/stride_sweep.py 512 512:2689:64 > $OUT/$C-stride.txt 2>&1; echo "stride rc=$? $(date -u +%H:%M:%S)" | tee -a $D
  cat $OUT/$C-stride.txt
fi
uniform() {
  local tree=$1 dir label
  if [ $tree = new ]; then dir=$PWD; label=$L; else dir=$PWD/../snapold; label=$OLD; fi
  local f=$OUT/$C-uniform-$tree-$(date -u +%H%M%S).txt
  (cd $dir && PYTHONPATH=/tmp/site:$dir timeout 75 python -m benchmarks.rl --cells opsd-uniform --candidates auto --repeats 1 --busy off --commit-label $label > $f 2>&1)
  echo "uniform $tree rc=$? $(date -u +%H:%M:%S)" | tee -a $D
  grep -E "^\| [0-9a-f]{7} |copy .* GEMM" $f | cut -c1-200
}
uniform new
uniform old
timeout 150 python -m benchmarks.step --cells uniform --paths packed --steps 1 --out $OUT/$C-step.json > $OUT/$C-step.txt 2>&1; echo "step rc=$? $(date -u +%H:%M:%S)" | tee -a $D
grep -E "^\||out of memory|Error" $OUT/$C-step.txt | cut -c1-400
[ -n "${SHORT:-}" ] || { uniform old; uniform new; }
