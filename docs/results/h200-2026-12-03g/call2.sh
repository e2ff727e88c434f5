set -u
D=$OUT/call2-dates.txt
nvidia-smi --query-gpu=name,driver_version --format=csv > $D
run() { local name=$1 limit=$2; shift 2; echo "$name start $(date -u +%H:%M:%S)" >> $D; timeout $limit "$@" > $OUT/call2-$name.txt 2>&1; echo "$name rc=$? end $(date -u +%H:%M:%S)" | tee -a $D; }
SMALL="--student qwen25-3b --teacher qwen25-3b --batch-size 4 --samples-per-prompt 4 --max-new-tokens 64 --prompt-len 64"
# the machine's first process (nothing timed from it): a profiled LoRA step (issue 32: no profiled LoRA step yet)
run lora-job 170 env OPSD_PROFILE=1 OPSD_PROFILE_STEPS=2 OPSD_PROFILE_DIR=/tmp/lora_traces python scripts/train_opsd.py $SMALL --steps 4 --lora 16
tail -6 $OUT/call2-lora-job.txt
run lora-summary 60 python scripts/summarize_trace.py /tmp/lora_traces --kernels 6
head -60 $OUT/call2-lora-summary.txt
# issue 33: light mode's cost with the work really fixed: lr 1e-30 leaves the bf16 weights unchanged, so every step
# repeats the same rollout (the same prompts and seed under --fixed-work)
run light 330 python -m benchmarks.profiler_cost light --pairs 150 --warmup 6 --fixed-work --gc-freeze --json-out $OUT/call2-light.json -- $SMALL --lr 1e-30
tail -6 $OUT/call2-light.txt
python - <<'PY'
import json, os, statistics as st
r = json.load(open(os.environ["OUT"] + "/call2-light.json"))["rows"][0]
print("sd on", round(st.stdev(r["on_ms"]), 2), "sd off", round(st.stdev(r["off_ms"]), 2), "diff sd", round(r["diff_sd_ms"], 2))
print("on", [round(x) for x in r["on_ms"][:30]])
PY
