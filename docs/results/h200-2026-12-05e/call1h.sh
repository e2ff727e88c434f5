# h200-2026-12-05e call 1h: call1.sh on an H100 (no H200 started; the OPSD step cell, 90 GiB, left out)
set -u
D=$OUT/call1h-dates.txt
nvidia-smi --query-gpu=name,driver_version --format=csv > $D
run() { local name=$1 limit=$2; shift 2; echo "$name start $(date -u +%H:%M:%S)" >> $D; timeout $limit "$@" > $OUT/call1h-$name.txt 2>&1; echo "$name rc=$? end $(date -u +%H:%M:%S)" | tee -a $D; }
# the machine's first process (nothing timed): the first-row reads' tests (the row cap among them) on CUDA
run tests 100 python -m pytest -q -p no:cacheprovider -rfE tests/test_decode_attention.py -k "first_row or route_reading or which_steps or how_an"
tail -2 $OUT/call1h-tests.txt
# the OPSD step's long-tail rollout (buckets compact from 256 rows to 32): the first-row reads up to 128 rows (the new
# default), off, and at every bucket (256), interleaved
run rlopsd 150 python -m benchmarks.rl --cells opsd-longtail --candidates auto --twin kernels.shared_prefix_first_row_rows=0 --twin kernels.shared_prefix_first_row_rows=256 --repeats 3 --busy off --commit-label 5eba8e2 --json $OUT/call1h-rlopsd.json
tail -5 $OUT/call1h-rlopsd.txt | cut -c1-250
# the uniform rollout (all 1,024 steps at 256 rows: the cap leaves them reading their own copies): default against off and every bucket (256)
run rl 170 python -m benchmarks.rl --cells opsd-uniform --candidates auto --twin kernels.shared_prefix_first_row_rows=0 --twin kernels.shared_prefix_first_row_rows=256 --repeats 2 --busy off --commit-label 5eba8e2 --json $OUT/call1h-rl.json
tail -4 $OUT/call1h-rl.txt | cut -c1-250

cat $D
