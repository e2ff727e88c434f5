set -u
D=$OUT/call1-dates.txt
nvidia-smi --query-gpu=name,driver_version --format=csv > $D
python -c "import torch, transformers, triton; print(torch.__version__, torch.version.cuda, transformers.__version__, triton.__version__)" >> $D
run() { local name=$1 limit=$2; shift 2; echo "$name start $(date -u +%H:%M:%S)" >> $D; timeout $limit "$@" > $OUT/call1-$name.txt 2>&1; echo "$name rc=$? end $(date -u +%H:%M:%S)" | tee -a $D; }
# the machine's first process (nothing timed): every GPU test on the tree after f3be2be (the repetition penalty's
# history from the first real token) with kernels.shared_prefix_columns
run tests 290 python -m pytest -m gpu -q -p no:cacheprovider -rfE tests
tail -4 $OUT/call1-tests.txt
# each prompt read once for its 4 samples at the uniform cell's windows (256-column prompts, 1,024 new tokens)
run shared 120 python -m benchmarks.decode_step --rows 256 128 --live 1280 --parts shared --shared-windows 256,320 256,448 256,704 256,960 256,1216 --json $OUT/call1-shared.json
grep -E "^\| (256|128) " $OUT/call1-shared.txt | cut -c1-230
# the opsd-uniform rollout with 256-column prompts shared (its twin), interleaved
run rl 150 python -m benchmarks.rl --cells opsd-uniform --candidates auto --twin kernels.shared_prefix_columns=256 --repeats 2 --busy off --json $OUT/call1-rl.json
tail -5 $OUT/call1-rl.txt | cut -c1-250
# the decode attention's split count between 64 and 128 rows; the SiLU·mul kernel's launches
run attention 90 python -m benchmarks.decode_step --rows 72 96 112 128 --live 704 --parts attention --json $OUT/call1-attention.json
run attention320 60 python -m benchmarks.decode_step --rows 96 112 --live 320 --parts attention --json $OUT/call1-attention320.json
grep -E "splits auto|1 split|^# " $OUT/call1-attention.txt $OUT/call1-attention320.txt | cut -c1-160
run silu 60 python -m benchmarks.decode_step --rows 8 64 256 --parts silu --json $OUT/call1-silu.json
grep -E "^\| " $OUT/call1-silu.txt | cut -c1-160 | head -40
cat $D
