#!/usr/bin/env bash
# GPU call 1 (2026-12-02 16:xx UTC, commit 9e62fec): the three experimental RolloutConfig fields measured
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD
export MASTER_ADDR=127.0.0.1 MASTER_PORT=29500 RANK=0 WORLD_SIZE=1 LOCAL_RANK=0
{ date -u; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; python3 -c "import torch, transformers, triton; print(torch.__version__, torch.version.cuda, transformers.__version__, triton.__version__)"; git rev-parse HEAD; } > $OUT/env.txt 2>&1
# first process on the machine: the GPU tests of the decode attention (continuous_shared_prefix's never ran on a GPU)
timeout 200 python3 -m pytest -q -x tests/test_decode_attention.py -k "gpu or cuda or continuous or shared" > $OUT/gputests-attention.txt 2>&1; echo "rc $?" >> $OUT/gputests-attention.txt
tail -3 $OUT/gputests-attention.txt
R="python3 scripts/bench_rollout.py --suite rl --model 3b --commit-label 9e62fec --eos-scales docs/results/h200-2026-12-01/rl-scales-3b.json"
timeout 330 $R --cells capped --candidates auto --twin continuous_stop_at_front=True --twin continuous_shared_prefix=True --repeats 4 --seeds 4 --busy off --json $OUT/rl-capped-experiments.json > $OUT/rl-capped-experiments.txt 2>&1; echo "rc $?" >> $OUT/rl-capped-experiments.txt
tail -8 $OUT/rl-capped-experiments.txt
timeout 120 python3 scripts/profile_decode_step.py --rows 128 512 --live 512 --parts step --split-k --json $OUT/splitk.json > $OUT/splitk.txt 2>&1; echo "rc $?" >> $OUT/splitk.txt
tail -12 $OUT/splitk.txt
