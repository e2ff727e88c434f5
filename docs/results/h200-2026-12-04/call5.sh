set -u
D=$OUT/call5-dates.txt
nvidia-smi --query-gpu=name,driver_version --format=csv > $D
run() { local name=$1 limit=$2; shift 2; echo "$name start $(date -u +%H:%M:%S)" >> $D; timeout $limit "$@" > $OUT/call5-$name.txt 2>&1; echo "$name rc=$? end $(date -u +%H:%M:%S)" | tee -a $D; }
# the machine's first process (untimed): the GPU tests of the touched code
run tests 60 python -m pytest -q -m gpu -x -p no:cacheprovider tests/test_bad_inputs_rollout.py tests/test_opsd_packed.py
tail -2 $OUT/call5-tests.txt
# issue 32 item 7, repeated in the other order: ZeRO-0, then ZeRO-3 (gather once, gradients reduced once a step); 2 steps after a warm-up
RL="--student qwen25-3b --teacher qwen25-3b --batch-size 64 --samples-per-prompt 4 --max-new-tokens 1024 --prompt-len 256 --steps 3 --nproc 1 --timeout 155 --work-dir /tmp/work"
run z0 140 python -m benchmarks.multigpu $RL --variants zero0 --out $OUT/call5-z0.json
run z3-once 160 python -m benchmarks.multigpu $RL --variants zero3-once --out $OUT/call5-z3-once.json
for f in z0 z3-once; do
python - $f <<'PY'
import json, os, sys
doc = json.load(open(os.environ["OUT"] + f"/call5-{sys.argv[1]}.json"))
for row in doc["rows"]:
    print(sys.argv[1], row["variant"], row["status"], "median", row["median_step_s"], "tok/s", row["rollout_tokens_per_s"], "peak", row["peak_gib_max"], "error", (row.get("error") or "")[-300:])
    for r in ((row.get("report") or {}).get("ranks") or [])[:1]:
        print("  step s", [round(x / 1e3, 2) for x in r["step_ms"]], "losses", [round(x, 5) for x in r["losses"]])
        for b in r["breakdown"]:
            dev = b.get("device_ms") or {}
            print("  path", b["train_path"], b["teacher_path"], b["student_path"], "mb", b["num_micro_batches"],
                  {k: round(v / 1e3, 2) for k, v in dev.items() if isinstance(v, (int, float))})
PY
done
cat $D
