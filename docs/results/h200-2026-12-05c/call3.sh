set -u
D=$OUT/call3-dates.txt
nvidia-smi --query-gpu=name,driver_version --format=csv > $D
python -c "import torch, transformers, triton; print(torch.__version__, torch.version.cuda, transformers.__version__, triton.__version__)" >> $D
run() { local name=$1 limit=$2; shift 2; echo "$name start $(date -u +%H:%M:%S)" >> $D; timeout $limit "$@" > $OUT/call3-$name.txt 2>&1; echo "$name rc=$? end $(date -u +%H:%M:%S)" | tee -a $D; }
# the machine's first process (nothing timed): the first-row reads' tests compiled for the GPU
run tests 90 python -m pytest -q -p no:cacheprovider -rfE tests/test_decode_attention.py -k "first_row or route_reading"
tail -2 $OUT/call3-tests.txt
# the long-tail cell (prompts 128..1,024, so the pass of their own shared them before): the first-row reads (now at
# every width) against kernels.shared_prefix_first_row=False (the pass), interleaved
run rllong 130 python -m benchmarks.rl --cells longtail-64-1024 --candidates auto --twin kernels.shared_prefix_first_row=False --repeats 3 --busy off --commit-label 8080647 --eos-scales docs/results/h200-2026-12-01/rl-scales-3b.json --json $OUT/call3-rllong.json
tail -4 $OUT/call3-rllong.txt | cut -c1-250
# the compacted buckets of that cell: 64 and 32 rows
run shared 60 python -m benchmarks.decode_step --rows 64 32 --live 1280 --parts shared --shared-windows 768,1024 254,448 --json $OUT/call3-shared.json
grep -E "^\| (64|32) " $OUT/call3-shared.txt | cut -c1-250
cat $D
