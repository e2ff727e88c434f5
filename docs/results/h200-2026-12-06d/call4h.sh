# h200-2026-12-06d call 4h (an H100): which tuned product slows the decode attention after it?
set -u
C=${CALL:-call4h}
D=$OUT/$C-dates.txt
nvidia-smi --query-gpu=name,driver_version --format=csv > $D
run() { local name=$1 limit=$2; shift 2; echo "$name start $(date -u +%H:%M:%S)" >> $D; timeout $limit "$@" > $OUT/$C-$name.txt 2>&1; echo "$name rc=$? end $(date -u +%H:%M:%S)" | tee -a $D; }
# the machine's first process (nothing timed)
run tests 80 python -m pytest -q -p no:cacheprovider -rfE tests/test_tuned_gemm.py
tail -1 $OUT/$C-tests.txt
run att 200 python docs/results/h200-2026-12-06d/attention_next_to_tuned.py
run att2 200 python docs/results/h200-2026-12-06d/attention_next_to_tuned.py
grep -v Warning $OUT/$C-att.txt $OUT/$C-att2.txt | cut -c1-400
cat $D
