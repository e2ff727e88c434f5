set -u
D=$OUT/call2-dates.txt
nvidia-smi --query-gpu=name,driver_version --format=csv > $D
python -c "import torch, transformers, triton; print(torch.__version__, torch.version.cuda, transformers.__version__, triton.__version__)" >> $D
run() { local name=$1 limit=$2; shift 2; echo "$name start $(date -u +%H:%M:%S)" >> $D; timeout $limit "$@" > $OUT/call2-$name.txt 2>&1; echo "$name rc=$? end $(date -u +%H:%M:%S)" | tee -a $D; }
# the decode step's four projections, 36 layers: x @ W.t() (today) against a kept W.t().contiguous(), cuBLASLt and
# cuBLAS (graph replays: nothing in it compiles per shape, so it may be the machine's first process)
run gemm 120 python -m benchmarks.gemm_layouts --rows 32 64 128 256 --json $OUT/call2-gemm.json
cat $OUT/call2-gemm.txt | cut -c1-200
# the opsd-uniform rollout at the new defaults (each row its own prompt copy), with one profiled call for GPU busy
run rl 150 python -m benchmarks.rl --cells opsd-uniform --candidates auto --repeats 2 --commit-label c110aa5 --json $OUT/call2-rl.json
tail -3 $OUT/call2-rl.txt | cut -c1-250
cat $D
