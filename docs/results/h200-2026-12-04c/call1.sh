set -u
D=$OUT/call1-dates.txt
nvidia-smi --query-gpu=name,driver_version --format=csv > $D
run() { local name=$1 limit=$2; shift 2; echo "$name start $(date -u +%H:%M:%S)" >> $D; timeout $limit "$@" > $OUT/call1-$name.txt 2>&1; echo "$name rc=$? end $(date -u +%H:%M:%S)" | tee -a $D; }
# the machine's first process (nothing timed): every GPU test on 47387b9 (b557ac8's shared Triton helpers of the sampler)
run tests 420 python -m pytest -m gpu -q -p no:cacheprovider -rfE tests
tail -4 $OUT/call1-tests.txt
# the decode attention's launch parameters at 8-128 rows (the long-tail cell's narrowing batches), 704 and 320 columns
run attention704 150 python -m benchmarks.decode_step --rows 8 32 64 128 --live 704 --parts attention --json $OUT/call1-attention704.json
run attention320 120 python -m benchmarks.decode_step --rows 32 128 256 --live 320 --parts attention --json $OUT/call1-attention320.json
grep -E "splits auto|^# " $OUT/call1-attention704.txt $OUT/call1-attention320.txt | cut -c1-160
cat $D
