# h200-2026-12-05e call 1t: call1.sh trimmed to the tests and the opsd-longtail A/B (the device time left after refusals)
set -u
D=$OUT/call1t-dates.txt
nvidia-smi --query-gpu=name,driver_version --format=csv > $D
run() { local name=$1 limit=$2; shift 2; echo "$name start $(date -u +%H:%M:%S)" >> $D; timeout $limit "$@" > $OUT/call1t-$name.txt 2>&1; echo "$name rc=$? end $(date -u +%H:%M:%S)" | tee -a $D; }
# the machine's first process (nothing timed): the first-row reads' tests (the row cap among them) on CUDA
run tests 100 python -m pytest -q -p no:cacheprovider -rfE tests/test_decode_attention.py -k "first_row or route_reading or which_steps or how_an"
tail -2 $OUT/call1t-tests.txt
# the OPSD step's long-tail rollout (buckets compact from 256 rows to 32): the first-row reads up to 128 rows (the new
# default), off, and at every bucket (256), interleaved
run rlopsd 150 python -m benchmarks.rl --cells opsd-longtail --candidates auto --twin kernels.shared_prefix_first_row_rows=0 --twin kernels.shared_prefix_first_row_rows=256 --repeats 3 --busy off --commit-label 5eba8e2 --json $OUT/call1t-rlopsd.json
tail -5 $OUT/call1t-rlopsd.txt | cut -c1-250
cat $D
