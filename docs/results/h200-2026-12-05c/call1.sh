set -u
D=$OUT/call1-dates.txt
nvidia-smi --query-gpu=name,driver_version --format=csv > $D
python -c "import torch, transformers, triton; print(torch.__version__, torch.version.cuda, transformers.__version__, triton.__version__)" >> $D
run() { local name=$1 limit=$2; shift 2; echo "$name start $(date -u +%H:%M:%S)" >> $D; timeout $limit "$@" > $OUT/call1-$name.txt 2>&1; echo "$name rc=$? end $(date -u +%H:%M:%S)" | tee -a $D; }
# the machine's first process (nothing timed): the decode attention's tests compiled for the GPU (the prompt read
# from each run's first row among them)
run tests 120 python -m pytest -q -p no:cacheprovider -rfE tests/test_decode_attention.py -k "first_row or shared or route_reading"
tail -2 $OUT/call1-tests.txt
# the opsd-uniform rollout and the long-tail cell: the defaults (the prompt from each run's first row) against
# kernels.shared_prefix_first_row=False, interleaved
run rl 200 python -m benchmarks.rl --cells opsd-uniform --candidates auto --twin kernels.shared_prefix_first_row=False --repeats 3 --busy off --commit-label 3cc4287 --json $OUT/call1-rl.json
tail -5 $OUT/call1-rl.txt | cut -c1-250
# the OPSD step at RL scale (uniform and long-tail cells, 3 timed steps each) at the new defaults
run step 280 python -m benchmarks.step --cells uniform,longtail --paths packed --steps 3 --out $OUT/call1-step.json
tail -30 $OUT/call1-step.txt | cut -c1-230
# 36 layers of attention, 4 samples a prompt: every row's own copy, the prefix pass, the prompt from the run's first row
run shared 120 python -m benchmarks.decode_step --rows 256 128 --live 1280 --parts shared --shared-windows 254,448 254,704 254,1216 256,704 768,1024 --json $OUT/call1-shared.json
grep -E "^\| (256|128) " $OUT/call1-shared.txt | cut -c1-250
run rllong 150 python -m benchmarks.rl --cells longtail-64-1024 --candidates auto --twin kernels.shared_prefix_first_row=False --repeats 3 --busy off --commit-label 3cc4287 --eos-scales docs/results/h200-2026-12-01/rl-scales-3b.json --json $OUT/call1-rllong.json
tail -5 $OUT/call1-rllong.txt | cut -c1-250
cat $D
