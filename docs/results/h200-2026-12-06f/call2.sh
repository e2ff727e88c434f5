# h200-2026-12-06f call 2 (any card; nothing timed): every test that needs CUDA (`pytest -m gpu tests`: the tests
# skipped in the CPU CI), in the machine's first process
set -u
C=${CALL:-call2}
D=$OUT/$C-dates.txt
nvidia-smi --query-gpu=name,driver_version --format=csv > $D
echo "gpu start $(date -u +%H:%M:%S)" >> $D
timeout ${LIMIT:-570} python -m pytest -q -p no:cacheprovider -rfEs --durations=15 -m gpu tests > $OUT/$C-gpu.txt 2>&1
echo "gpu rc=$? end $(date -u +%H:%M:%S)" | tee -a $D
grep -E "passed|failed|error|FAILED|ERROR" $OUT/$C-gpu.txt | tail -15
cat $D
