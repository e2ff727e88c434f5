# h200-2026-12-07f call 1 (needs an H200: the 3B/3B OPSD step peaks at 90 GiB). Run from the copy of this tree, with
# the old tree (git archive $OLD) at ../snapold.
# 1. The machine's first process (nothing timed): the KV storage and decode attention padding tests on CUDA.
# 2. The shared-prompt table's 256-row figures on the padded storage.
# 3. opsd-uniform at the defaults, then the old tree's in a process of its own.
# 4. The OPSD step's uniform cell (a warm-up step, one timed).
set -u
L=${LABEL:?commit label}
OLD=${OLD:?old tree label}
C=${CALL:-call1}
D=$OUT/$C-dates.txt
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > $D
timeout 60 python -m pytest -q -p no:cacheprovider tests/test_decode_attention.py tests/test_kv_storage.py \
  -k "storage or padding" > $OUT/$C-tests.txt 2>&1
echo "tests rc=$? $(date -u +%H:%M:%S)" | tee -a $D; tail -1 $OUT/$C-tests.txt
timeout 60 python -m benchmarks.decode_step --rows 256 --live 1280 --parts shared \
  --shared-windows 254,704 256,704 --json $OUT/$C-shared.json > $OUT/$C-shared.txt 2>&1
echo "shared rc=$? $(date -u +%H:%M:%S)" | tee -a $D
grep -E "^\|" $OUT/$C-shared.txt | cut -c1-220
timeout 90 python -m benchmarks.rl --cells opsd-uniform --candidates auto --repeats 2 --busy off --commit-label $L > $OUT/$C-rl.txt 2>&1
echo "rl rc=$? $(date -u +%H:%M:%S)" | tee -a $D
grep -E "^\| [0-9a-f]{7} " $OUT/$C-rl.txt | cut -c1-220
(cd ../snapold && PYTHONPATH=/tmp/site:$PWD timeout 75 python -m benchmarks.rl --cells opsd-uniform --candidates auto \
  --repeats 1 --busy off --commit-label $OLD > $OUT/$C-uniform-old.txt 2>&1)
echo "uniform old rc=$? $(date -u +%H:%M:%S)" | tee -a $D
grep -E "^\| [0-9a-f]{7} " $OUT/$C-uniform-old.txt | cut -c1-220
timeout 150 python -m benchmarks.step --cells uniform --paths packed --steps 1 --out $OUT/$C-step.json \
  > $OUT/$C-step.txt 2>&1
echo "step rc=$? $(date -u +%H:%M:%S)" | tee -a $D
grep -E "^\||out of memory|Error" $OUT/$C-step.txt | cut -c1-400
