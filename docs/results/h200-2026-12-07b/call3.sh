# h200-2026-12-07b call 3 (any card): the KV storage padded to an odd multiple of 16 KiB a row and KV head (this
# tree: the opsd cells' 1,280 columns stored as 1,344) against 2a6355b (OLD, ../snapold), in alternating processes.
# First process (nothing timed): the storage tests and the decode attention's padding tests on CUDA. Then the stride
# sweep of calls 6-7 on this card (stride_sweep.py), then `python -m benchmarks.rl --cells <cell> --candidates auto
# --repeats 1 --busy off` in the two trees, new old old new, for opsd-uniform and opsd-longtail
set -u
L=${LABEL:?commit label}
OLD=${OLD:?old tree label}
C=${CALL:-call3}
H=docs/results/h200-2026-12-07b
D=$OUT/$C-dates.txt
nvidia-smi --query-gpu=name,driver_version --format=csv > $D
timeout 120 python -m pytest -q -p no:cacheprovider tests/test_kv_storage.py tests/test_decode_attention.py -k "storage or padding or first_tile" > $OUT/$C-tests.txt 2>&1; echo "tests rc=$?" | tee -a $D
tail -1 $OUT/$C-tests.txt
timeout 60 python $H/stride_sweep.py 512 512:2689:64 > $OUT/$C-stride512.txt 2>&1; echo "stride rc=$?" | tee -a $D
sort -t, -k1 $OUT/$C-stride512.txt | grep -E "capacity (1280|1344|2560|768|1536|2304) " | cut -c1-120
for cell in ${CELLS:-opsd-uniform opsd-longtail}; do
  for tree in new old old new; do
    if [ $tree = new ]; then dir=$PWD; label=$L; else dir=$PWD/../snapold; label=$OLD; fi
    f=$OUT/$C-$cell-$tree-$(date -u +%H%M%S).txt
    (cd $dir && PYTHONPATH=/tmp/site:$dir timeout 100 python -m benchmarks.rl --cells $cell --candidates auto --repeats 1 --busy off --commit-label $label > $f 2>&1)
    echo "$cell $tree rc=$? end $(date -u +%H:%M:%S)" | tee -a $D
    grep -E "^\| [0-9a-f]{7} " $f | cut -c1-140
  done
done
cat $D
