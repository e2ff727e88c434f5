set -u
nvidia-smi --query-gpu=name,driver_version --format=csv > $OUT/call1-dates.txt
run() { local name=$1 limit=$2; shift 2; echo "$name start $(date -u +%H:%M:%S)" >> $OUT/call1-dates.txt; timeout $limit "$@" > $OUT/call1-$name.txt 2>&1; echo "$name rc=$? end $(date -u +%H:%M:%S)" | tee -a $OUT/call1-dates.txt; }
run tests 120 python -m pytest -q -p no:logging tests/test_opsd_lora_pass.py tests/test_train_compile.py
tail -2 $OUT/call1-tests.txt
JOB="python scripts/train_opsd.py --student qwen25-3b --teacher qwen25-3b --batch-size 4 --samples-per-prompt 4 --max-new-tokens 64 --prompt-len 64 --steps 10"
here=$PWD
for i in 0 1 2 3; do
  cd $here/.ab/9e62fec && run old$i 80 env PYTHONPATH=/tmp/site:$here/.ab/9e62fec $JOB
  cd $here && run new$i 80 env PYTHONPATH=/tmp/site:$here $JOB
done
cd $here
for f in $OUT/call1-old*.txt $OUT/call1-new*.txt; do echo "$(basename $f): $(grep -oE '^\[[0-9]+/10\] step [0-9]+ .* step [0-9.]+ ms' $f | grep -oE '[0-9.]+ ms$' | tr -d 'ms' | tr '\n' ' ') | $(grep -o 'mean step [0-9.]* ms' $f)"; done
