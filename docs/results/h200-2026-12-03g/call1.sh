set -u
D=$OUT/call1-dates.txt
nvidia-smi --query-gpu=name,driver_version --format=csv > $D
python -c "import torch,transformers,deepspeed,triton;print('torch',torch.__version__,'cuda',torch.version.cuda,'transformers',transformers.__version__,'deepspeed',deepspeed.__version__,'triton',triton.__version__)" >> $D 2>/dev/null
run() { local name=$1 limit=$2; shift 2; echo "$name start $(date -u +%H:%M:%S)" >> $D; timeout $limit "$@" > $OUT/call1-$name.txt 2>&1; echo "$name rc=$? end $(date -u +%H:%M:%S)" | tee -a $D; }
# the machine's first process (untimed): the GPU tests of the packed passes
run tests 130 python -m pytest -q -m gpu tests/test_opsd_packed.py tests/test_opsd_lora_pass.py tests/test_train_compile.py
tail -3 $OUT/call1-tests.txt
run zero 430 python -m benchmarks.multigpu --student qwen25-3b --teacher qwen25-3b --batch-size 64 --samples-per-prompt 4 --max-new-tokens 1024 --prompt-len 256 --steps 4 --nproc 1 --variants zero0 zero3-once --timeout 210 --out $OUT/call1-zero.json --work-dir /tmp/work
tail -8 $OUT/call1-zero.txt
python - <<'PY'
import json, os
doc = json.load(open(os.environ["OUT"] + "/call1-zero.json"))
for row in doc["rows"]:
    print(row["variant"], row["status"], "median", row["median_step_s"], "tok/s", row["rollout_tokens_per_s"], "peak", row["peak_gib_max"], "error", (row.get("error") or "")[-300:])
    for r in ((row.get("report") or {}).get("ranks") or [])[:1]:
        print("  step s", [round(x / 1e3, 2) for x in r["step_ms"]], "losses", [round(x, 5) for x in r["losses"]])
        for b in r["breakdown"]:
            dev = b.get("device_ms") or {}
            print("  path", b["train_path"], b["teacher_path"], b["student_path"], "mb", b["num_micro_batches"],
                  {k: round(v / 1e3, 2) for k, v in dev.items() if isinstance(v, (int, float))})
PY
