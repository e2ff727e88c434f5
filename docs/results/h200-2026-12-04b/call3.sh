set -u
D=$OUT/call3-dates.txt
nvidia-smi --query-gpu=name,driver_version --format=csv > $D
run() { local name=$1 limit=$2; shift 2; echo "$name start $(date -u +%H:%M:%S)" >> $D; timeout $limit "$@" > $OUT/call3-$name.txt 2>&1; echo "$name rc=$? end $(date -u +%H:%M:%S)" | tee -a $D; }
# the machine's first process when it is a fresh one (not timed for the record)
run tests 60 python -m pytest -m gpu -q -x -p no:cacheprovider tests/test_gpu_rl.py -k residual
tail -2 $OUT/call3-tests.txt
# issue 32: the long-tail cell alone in its process (in call 2 it ran after the uniform cell, whose memory it met)
run longtail 240 python -m benchmarks.step --cells longtail --paths packed --steps 3 --out $OUT/call3-longtail.json
tail -4 $OUT/call3-longtail.txt
# issue 32, not yet run on a GPU: a LoRA student (r = 16) under ZeRO-3 gathered once with its gradients reduced once a
# step (the default), against ZeRO-0, at 16 x 4 x 256
J="--student qwen25-3b --teacher qwen25-3b --batch-size 16 --samples-per-prompt 4 --max-new-tokens 256 --prompt-len 256 --steps 5 --nproc 1 --lora 16 --timeout 110 --work-dir /tmp/work"
run lora-z3 120 python -m benchmarks.multigpu $J --variants zero3-once --out $OUT/call3-lora-z3.json
run lora-z0 120 python -m benchmarks.multigpu $J --variants zero0 --out $OUT/call3-lora-z0.json
tail -6 $OUT/call3-lora-z3.txt $OUT/call3-lora-z0.txt
cat $D
