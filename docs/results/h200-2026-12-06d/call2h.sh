# h200-2026-12-06d call 2h (an H100): does split-K's float32 workspace cost the next kernel a write-back?
set -u
C=${CALL:-call2h}
D=$OUT/$C-dates.txt
nvidia-smi --query-gpu=name,driver_version --format=csv > $D
run() { local name=$1 limit=$2; shift 2; echo "$name start $(date -u +%H:%M:%S)" >> $D; timeout $limit "$@" > $OUT/$C-$name.txt 2>&1; echo "$name rc=$? end $(date -u +%H:%M:%S)" | tee -a $D; }
# the machine's first process (nothing timed)
run tests 80 python -m pytest -q -p no:cacheprovider -rfE tests/test_tuned_gemm.py
tail -1 $OUT/$C-tests.txt
run l2 120 python docs/results/h200-2026-12-06d/l2_writeback.py
run l2b 120 python docs/results/h200-2026-12-06d/l2_writeback.py
cat $OUT/$C-l2.txt $OUT/$C-l2b.txt
cat $D
