set -u
D=$OUT/call3-dates.txt
nvidia-smi --query-gpu=name,driver_version --format=csv > $D
run() { local name=$1 limit=$2; shift 2; echo "$name start $(date -u +%H:%M:%S)" >> $D; timeout $limit "$@" > $OUT/call3-$name.txt 2>&1; echo "$name rc=$? end $(date -u +%H:%M:%S)" | tee -a $D; }
RL="--student qwen25-3b --teacher qwen25-3b --batch-size 64 --samples-per-prompt 4 --max-new-tokens 1024 --prompt-len 256 --steps 3 --nproc 1"
# the machine's first process (untimed)
run tests 50 python -m pytest -q -m gpu tests/test_opsd_lora_pass.py
tail -2 $OUT/call3-tests.txt
# the opposite order of call 1 (ZeRO-3 first), then both with a LoRA student (r = 16 on q/k/v/o)
run zero 270 python -m benchmarks.multigpu $RL --variants zero3-once zero0 --timeout 130 --out $OUT/call3-zero.json --work-dir /tmp/work1
run lora 250 python -m benchmarks.multigpu $RL --lora 16 --variants zero3-once zero0 --timeout 120 --out $OUT/call3-lora.json --work-dir /tmp/work2
python - <<'PY'
import json, os
for name in ("zero", "lora"):
    doc = json.load(open(os.environ["OUT"] + f"/call3-{name}.json"))
    for row in doc["rows"]:
        print(name, row["variant"], row["status"], "median", row["median_step_s"], "tok/s", row["rollout_tokens_per_s"], "peak", row["peak_gib_max"], "error", (row.get("error") or "")[-400:])
        for r in ((row.get("report") or {}).get("ranks") or [])[:1]:
            print("  step s", [round(x / 1e3, 2) for x in r["step_ms"]], "losses", [round(x, 5) for x in r["losses"]])
            for b in r["breakdown"]:
                dev = b.get("device_ms") or {}
                print("  path", b["train_path"], b["teacher_path"], b["student_path"], "mb", b["num_micro_batches"],
                      {k: round(v / 1e3, 2) for k, v in dev.items() if isinstance(v, (int, float))})
PY
