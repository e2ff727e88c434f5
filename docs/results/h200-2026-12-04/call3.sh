set -u
D=$OUT/call3-dates.txt
nvidia-smi --query-gpu=name,driver_version --format=csv > $D
run() { local name=$1 limit=$2; shift 2; echo "$name start $(date -u +%H:%M:%S)" >> $D; timeout $limit "$@" > $OUT/call3-$name.txt 2>&1; echo "$name rc=$? end $(date -u +%H:%M:%S)" | tee -a $D; }
# issue 32 item 7: where ZeRO-3's extra backward time goes. One profiled step (step 2) of the main job under ZeRO-0
# and under ZeRO-3 (gather once), same seeds and shapes; kernels per stage from summarize_trace.py
MID="--student qwen25-3b --teacher qwen25-3b --batch-size 16 --samples-per-prompt 4 --max-new-tokens 512 --prompt-len 256 --steps 3"
for z in 0 3; do
  run job-z$z 200 env OPSD_PROFILE=1 OPSD_PROFILE_STEPS=2 OPSD_PROFILE_MEMORY=0 OPSD_PROFILE_DIR=/tmp/tr_z$z python scripts/train_opsd.py $MID --zero-stage $z --json-out $OUT/call3-job-z$z.json
  tail -4 $OUT/call3-job-z$z.txt
  run sum-z$z 100 python scripts/summarize_trace.py /tmp/tr_z$z --kernels 12
  head -70 $OUT/call3-sum-z$z.txt
done
cat $D
