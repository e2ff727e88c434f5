# h200-2026-12-06e call 3 (call 2 cut to what the device time left allowed): the fused kernel's CUDA tests, then the
# decode step at 8-256 rows with the rotary inside the attention against apart, at every row count (the threshold of
# kernels.rotary_in_attention_rows)
set -u
C=${CALL:-call3}
D=$OUT/$C-dates.txt
nvidia-smi --query-gpu=name,driver_version --format=csv > $D
run() { local name=$1 limit=$2; shift 2; echo "$name start $(date -u +%H:%M:%S)" >> $D; timeout $limit "$@" > $OUT/$C-$name.txt 2>&1; echo "$name rc=$? end $(date -u +%H:%M:%S)" | tee -a $D; }
# the machine's first process (nothing timed)
run tests 90 python -m pytest -q -p no:cacheprovider -rfE tests/test_rotary_attention.py tests/test_rotary_write.py
tail -3 $OUT/$C-tests.txt
run rows 130 python docs/results/h200-2026-12-06e/rotary_rows.py 8 16 24 32 48 64 128 256
grep -E "^\||H100|H200" $OUT/$C-rows.txt
cat $D
