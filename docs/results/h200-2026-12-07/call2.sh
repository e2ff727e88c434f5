# h200-2026-12-07 call 2 (any card: the cell peaks at 22.5 GiB; a fresh machine). The machine's first process (nothing
# timed): the decode attention's and the fused rotary's CUDA tests (the window now starts at each row's first kept
# column). Then one profiled call of opsd-uniform with our stage ranges (OPSD_PROFILE=1), its kernels summed by name and
# grid per decode step, the synthetic 256-row decode step's kernel table at 768 live columns (about the cell's mean),
# and the attention over left-padded prompts from the first kept column against from the tile edge (--parts padding).
# nvidia-smi samples the SM clock, power and clock-event reasons every 250 ms throughout ($C-smi.csv), to tell a
# sustained call's clocks from a short replay's. NO_SUMMARY=1: no stage summary (short of device time)
set -u
L=${LABEL:?commit label}
C=${CALL:-call2}
D=$OUT/$C-dates.txt
H=docs/results/h200-2026-12-07
nvidia-smi --query-gpu=name,driver_version --format=csv > $D
run() { local name=$1 limit=$2; shift 2; echo "$name start $(date -u +%H:%M:%S)" >> $D; timeout $limit "$@" > $OUT/$C-$name.txt 2>&1; echo "$name rc=$? end $(date -u +%H:%M:%S)" | tee -a $D; }
Q=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu
(timeout 500 nvidia-smi --query-gpu=$Q,clocks_event_reasons.active --format=csv -lms 250 || timeout 500 nvidia-smi --query-gpu=$Q --format=csv -lms 250) > $OUT/$C-smi.csv 2>&1 &
SMI=$!
run tests 150 python -m pytest -q -p no:cacheprovider -rfE tests/test_decode_attention.py tests/test_rotary_attention.py
tail -2 $OUT/$C-tests.txt
mkdir -p /tmp/tr
export OPSD_PROFILE=1
run rl 200 python -m benchmarks.rl --cells opsd-uniform --candidates auto --repeats 2 --busy on --trace-dir /tmp/tr --commit-label $L --json $OUT/$C-rl.json
unset OPSD_PROFILE
grep -E "^\| [0-9a-f]{7} " $OUT/$C-rl.txt | cut -c1-250
T=$(ls /tmp/tr/*.json | head -1)
ls -la /tmp/tr
run kernels 90 python $H/kernels_of_trace.py $T 1024 45
head -30 $OUT/$C-kernels.txt
[ -n "${NO_SUMMARY:-}" ] || run summary 60 python scripts/summarize_trace.py --format markdown --kernels 8 $T
head -40 $OUT/$C-summary.txt
run step 90 python -m benchmarks.decode_step --rows 256 --live 768 --parts step padding --kernels
grep -E "^\|" $OUT/$C-step.txt | tail -24
kill $SMI; pkill -f 'nvidia-smi --query-gpu=timestamp'
gzip -1 -c $T > $OUT/$C-trace.json.gz
cat $D
