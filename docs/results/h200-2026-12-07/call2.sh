# h200-2026-12-07 call 2 (any card: the cell peaks at 22.5 GiB; a fresh machine): opsd-uniform once in
# the machine's first process (nothing kept), then one profiled call of it with our stage ranges (OPSD_PROFILE=1),
# its kernels summed by name and grid per decode step, and the synthetic 256-row decode step's kernel table at 768
# live columns (about the cell's mean) for comparison; NO_WARM=1: no warm-up process and no stage summary (short of device time)
set -u
L=${LABEL:?commit label}
C=${CALL:-call2}
D=$OUT/$C-dates.txt
H=docs/results/h200-2026-12-07
nvidia-smi --query-gpu=name,driver_version --format=csv > $D
run() { local name=$1 limit=$2; shift 2; echo "$name start $(date -u +%H:%M:%S)" >> $D; timeout $limit "$@" > $OUT/$C-$name.txt 2>&1; echo "$name rc=$? end $(date -u +%H:%M:%S)" | tee -a $D; }
[ -n "${NO_WARM:-}" ] || run warm 100 python -m benchmarks.rl --cells opsd-uniform --candidates auto --repeats 1 --busy off --commit-label $L
mkdir -p /tmp/tr
export OPSD_PROFILE=1
run rl 200 python -m benchmarks.rl --cells opsd-uniform --candidates auto --repeats 2 --busy on --trace-dir /tmp/tr --commit-label $L --json $OUT/$C-rl.json
unset OPSD_PROFILE
grep -E "^\| [0-9a-f]{7} " $OUT/$C-rl.txt | cut -c1-250
T=$(ls /tmp/tr/*.json | head -1)
ls -la /tmp/tr
run kernels 90 python $H/kernels_of_trace.py $T 1024 45
head -30 $OUT/$C-kernels.txt
[ -n "${NO_WARM:-}" ] || run summary 60 python scripts/summarize_trace.py --format markdown --kernels 8 $T
head -40 $OUT/$C-summary.txt
run step 70 python -m benchmarks.decode_step --rows 256 --live 768 --parts step --kernels
grep -E "^\|" $OUT/$C-step.txt | tail -20
gzip -1 -c $T > $OUT/$C-trace.json.gz
cat $D
