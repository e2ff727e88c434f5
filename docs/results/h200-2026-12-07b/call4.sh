# h200-2026-12-07b call 4 (needs an H200: the 3B/3B OPSD step peaks at 90 GiB; ~270 s of device time left): first
# process (nothing timed) the storage and padding tests on CUDA; then the OPSD step's uniform cell at this tree (one
# timed step after a warm-up step), the stride sweep at a few widths, and opsd-uniform once in each tree (new, old)
set -u
L=${LABEL:?commit label}
OLD=${OLD:?old tree label}
C=${CALL:-call4}
H=docs/results/h200-2026-12-07b
D=$OUT/$C-dates.txt
nvidia-smi --query-gpu=name,driver_version --format=csv > $D
timeout 60 python -m pytest -q -p no:cacheprovider tests/test_kv_storage.py tests/test_decode_attention.py -k "storage or padding" > $OUT/$C-tests.txt 2>&1; echo "tests rc=$? $(date -u +%H:%M:%S)" | tee -a $D
tail -1 $OUT/$C-tests.txt
timeout 150 python -m benchmarks.step --cells uniform --paths packed --steps 1 --out $OUT/$C-step.json > $OUT/$C-step.txt 2>&1; echo "step rc=$? $(date -u +%H:%M:%S)" | tee -a $D
grep -E "^\||out of memory|Error" $OUT/$C-step.txt | cut -c1-400
timeout 30 python $H/stride_sweep.py 512 768 1280 1344 1536 2304 2368 2560 2624 > $OUT/$C-stride.txt 2>&1; echo "stride rc=$?" | tee -a $D
cat $OUT/$C-stride.txt
for tree in new old; do
  if [ $tree = new ]; then dir=$PWD; label=$L; else dir=$PWD/../snapold; label=$OLD; fi
  (cd $dir && PYTHONPATH=/tmp/site:$dir timeout 60 python -m benchmarks.rl --cells opsd-uniform --candidates auto --repeats 1 --busy off --commit-label $label > $OUT/$C-uniform-$tree.txt 2>&1)
  echo "uniform $tree rc=$? $(date -u +%H:%M:%S)" | tee -a $D
  grep -E "^\| [0-9a-f]{7} " $OUT/$C-uniform-$tree.txt | cut -c1-140
done
