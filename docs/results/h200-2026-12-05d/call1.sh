set -u
D=$OUT/call1-dates.txt
nvidia-smi --query-gpu=name,driver_version --format=csv > $D
python -c "import torch, transformers, triton; print(torch.__version__, torch.version.cuda, transformers.__version__, triton.__version__)" >> $D
run() { local name=$1 limit=$2; shift 2; echo "$name start $(date -u +%H:%M:%S)" >> $D; timeout $limit "$@" > $OUT/call1-$name.txt 2>&1; echo "$name rc=$? end $(date -u +%H:%M:%S)" | tee -a $D; }
# the machine's first process (nothing timed): the decode attention's tests compiled for the GPU
run tests 70 python -m pytest -q -p no:cacheprovider -rfE tests/test_decode_attention.py -k "first_row or shared or route_reading"
tail -2 $OUT/call1-tests.txt
# the opsd-uniform rollout, interleaved: the defaults (each prompt's tiles from its run's first row, the prompts padded
# in front to end at a tile edge), kernels.shared_prefix_align=False (the straddling tile from each row's own copy)
# and kernels.shared_prefix_first_row=False (each row its own copy)
run rl 150 python -m benchmarks.rl --cells opsd-uniform --candidates auto --twin kernels.shared_prefix_align=False --twin kernels.shared_prefix_first_row=False --repeats 3 --busy off --commit-label 0064eb7 --json $OUT/call1-rl.json
tail -6 $OUT/call1-rl.txt | cut -c1-250
# the OPSD step at RL scale (uniform and long-tail cells, 3 timed steps each) at the defaults
run step 220 python -m benchmarks.step --cells uniform,longtail --paths packed --steps 3 --out $OUT/call1-step.json
tail -30 $OUT/call1-step.txt | cut -c1-230
# the long-tail cell (prompts padded past 512 columns): the default (the prefix pass) against the first-row reads at
# every width (kernels.shared_prefix_columns=100000), interleaved
run rllong 80 python -m benchmarks.rl --cells longtail-64-1024 --candidates auto --twin kernels.shared_prefix_columns=100000 --repeats 3 --busy off --commit-label 0064eb7 --eos-scales docs/results/h200-2026-12-01/rl-scales-3b.json --json $OUT/call1-rllong.json
tail -5 $OUT/call1-rllong.txt | cut -c1-250
# 36 layers of attention, 4 samples a prompt: every row's own copy, the prefix pass, the prompt from the run's first row
run shared 50 python -m benchmarks.decode_step --rows 256 128 64 32 --live 1280 --parts shared --shared-windows 254,704 256,704 768,1024 --json $OUT/call1-shared.json
grep -E "^\| (256|128|64|32) " $OUT/call1-shared.txt | cut -c1-250
cat $D
