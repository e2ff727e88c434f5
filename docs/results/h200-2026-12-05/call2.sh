set -u
D=$OUT/call2-dates.txt
nvidia-smi --query-gpu=name,driver_version --format=csv > $D
run() { local name=$1 limit=$2; shift 2; echo "$name start $(date -u +%H:%M:%S)" >> $D; timeout $limit "$@" > $OUT/call2-$name.txt 2>&1; echo "$name rc=$? end $(date -u +%H:%M:%S)" | tee -a $D; }
# the machine's first process (nothing timed): the SiLU·mul kernel compiled and checked at 8 rows
run warmup 90 python -m benchmarks.decode_step --rows 8 --parts silu
# the OPSD step at RL scale on the tree of cf4eea0 (uniform and long-tail cells, 3 timed steps each)
run step 260 python -m benchmarks.step --cells uniform,longtail --paths packed --steps 3 --out $OUT/call2-step.json
tail -30 $OUT/call2-step.txt | cut -c1-230
# where cuBLASLt's lead on the 256-row step comes from: the step and each projection under both backends
run blas 150 python -m benchmarks.decode_step --rows 256 --live 704 --parts step --blas cublas cublaslt --kernels --json $OUT/call2-blas.json
grep -E "^\| 256 " $OUT/call2-blas.txt | cut -c1-200
cat $D
