# h200-2026-12-06d call 5h (an H100): call 4h's A/B with the variants built in the reverse order (each allocates its
# own cache), so the cache's placement cannot make the attention's figure
set -u
C=${CALL:-call5h}
D=$OUT/$C-dates.txt
nvidia-smi --query-gpu=name,driver_version --format=csv > $D
run() { local name=$1 limit=$2; shift 2; echo "$name start $(date -u +%H:%M:%S)" >> $D; timeout $limit "$@" > $OUT/$C-$name.txt 2>&1; echo "$name rc=$? end $(date -u +%H:%M:%S)" | tee -a $D; }
[ -n "${FIRST:-}" ] && run tests 80 python -m pytest -q -p no:cacheprovider -rfE tests/test_tuned_gemm.py
run att 200 env REVERSE=1 python docs/results/h200-2026-12-06d/attention_next_to_tuned.py
grep -v Warning $OUT/$C-att.txt | cut -c1-300
cat $D
