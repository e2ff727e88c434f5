# h200-2026-12-06d call 1h (an H100: no H200 came): why wide-greedy loses with kernels.blas_library='cublaslt-tuned'.
# A profiled call of each candidate on wide-greedy and wide-sampled (the same step shapes, another sampler), the GPU's
# clocks and power sampled every 100 ms meanwhile, and each cell's kernels summed by name, default against tuned.
set -u
L=${LABEL:?commit label}
C=${CALL:-call1h}
D=$OUT/$C-dates.txt
nvidia-smi --query-gpu=name,driver_version --format=csv > $D
run() { local name=$1 limit=$2; shift 2; echo "$name start $(date -u +%H:%M:%S)" >> $D; timeout $limit "$@" > $OUT/$C-$name.txt 2>&1; echo "$name rc=$? end $(date -u +%H:%M:%S)" | tee -a $D; }
T="kernels.blas_library='cublaslt-tuned'"
# the machine's first process (nothing timed)
run tests 80 python -m pytest -q -p no:cacheprovider -rfE tests/test_tuned_gemm.py tests/test_blas.py
tail -1 $OUT/$C-tests.txt
nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu,utilization.gpu --format=csv,noheader -lms 100 > $OUT/$C-clocks.csv 2>&1 &
SMI=$!
TR=/tmp/traces
run rl 300 env OPSD_PROFILE=1 python -m benchmarks.rl --cells wide-greedy,wide-sampled --candidates auto --twin "$T" --repeats 3 --busy on --trace-dir $TR --commit-label $L --json $OUT/$C-rl.json
kill $SMI
grep -E "^\| [0-9a-f]{7} " $OUT/$C-rl.txt | cut -c1-250
ls -la $TR
for cell in wide-greedy wide-sampled; do
  A=$TR/$cell--auto.json; B=$(ls $TR/$cell--auto_*.json)
  run sum-$cell 120 python scripts/summarize_trace.py $B --diff $A --kernels 12
  python - "$A" "$B" > $OUT/$C-kernels-$cell.txt 2>&1 <<'PY'
import json, sys, collections
def load(p):
    ev = json.load(open(p))
    ev = ev.get("traceEvents", ev) if isinstance(ev, dict) else ev
    tot, cnt = collections.Counter(), collections.Counter()
    for e in ev:
        if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") and e.get("ph") == "X":
            tot[e["name"][:90]] += e.get("dur", 0); cnt[e["name"][:90]] += 1
    return tot, cnt
(a, na), (b, nb) = load(sys.argv[1]), load(sys.argv[2])
print(f"total GPU us: default {sum(a.values()):.0f}  tuned {sum(b.values()):.0f}")
print("| kernel | default us (n) | tuned us (n) | tuned - default |")
for k in sorted(set(a) | set(b), key=lambda k: -max(a[k], b[k]))[:30]:
    print(f"| {k} | {a[k]:.0f} ({na[k]}) | {b[k]:.0f} ({nb[k]}) | {b[k]-a[k]:+.0f} |")
PY
  cat $OUT/$C-kernels-$cell.txt | head -34
done
python - $OUT/$C-clocks.csv <<'PY'
import sys, statistics
rows = [l.split(", ") for l in open(sys.argv[1]) if l.count(",") >= 5]
sm = [float(r[1].split()[0]) for r in rows if r[1].split()[0].replace(".", "").isdigit()]
pw = [float(r[3].split()[0]) for r in rows if r[3].split()[0].replace(".", "").isdigit()]
print(f"samples {len(rows)}; SM clock MHz min/median/max {min(sm)}/{statistics.median(sm)}/{max(sm)}; power W median/max {statistics.median(pw)}/{max(pw)}")
PY
cat $D
