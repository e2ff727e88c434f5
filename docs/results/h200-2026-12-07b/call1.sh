# h200-2026-12-07b call 1 (needs an H200: the 3B/3B OPSD step peaks at 90 GiB; a fresh machine). The machine's first
# process (nothing timed): the decode attention's, the fused rotary's and the ordinary route's CUDA tests. Then the OPSD
# step's uniform cell at this tree (the rollout reading no left padding and generating the longest prompts first), and
# the attention over left-padded prompts in request order, longest first, and from the tile edge (--parts padding) at
# 128..1,280 columns. nvidia-smi samples the SM clock, power and clock-event reasons every 250 ms ($C-smi.csv)
set -u
L=${LABEL:?commit label}
C=${CALL:-call1}
D=$OUT/$C-dates.txt
nvidia-smi --query-gpu=name,driver_version --format=csv > $D
run() { local name=$1 limit=$2; shift 2; echo "$name start $(date -u +%H:%M:%S)" >> $D; timeout $limit "$@" > $OUT/$C-$name.txt 2>&1; echo "$name rc=$? end $(date -u +%H:%M:%S)" | tee -a $D; }
Q=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu
(timeout 560 nvidia-smi --query-gpu=$Q,clocks_event_reasons.active --format=csv -lms 250 || timeout 560 nvidia-smi --query-gpu=$Q --format=csv -lms 250) > $OUT/$C-smi.csv 2>&1 &
SMI=$!
run tests 150 python -m pytest -q -p no:cacheprovider -rfE tests/test_decode_attention.py tests/test_rotary_attention.py tests/test_ordinary_route.py
tail -2 $OUT/$C-tests.txt
[ -n "${NO_STEP:-}" ] || run step 300 python -m benchmarks.step --cells uniform --paths packed --steps 3 --out $OUT/$C-step.json
[ -n "${NO_STEP:-}" ] || grep -E "^\||out of memory|Error" $OUT/$C-step.txt | cut -c1-400
for live in ${LIVE:-128 320 512 768 1024 1280}; do
  run pad$live 60 python -m benchmarks.decode_step --rows 256 --live $live --parts padding
  grep -E "^\| 256" $OUT/$C-pad$live.txt | cut -c1-250
done
kill $SMI; pkill -f 'nvidia-smi --query-gpu=timestamp'
cat $D
