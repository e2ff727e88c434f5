set -u
D=$OUT/call2-dates.txt
nvidia-smi --query-gpu=name,driver_version --format=csv > $D
python -c "import torch, transformers, triton; print(torch.__version__, torch.version.cuda, transformers.__version__, triton.__version__)" >> $D
run() { local name=$1 limit=$2; shift 2; echo "$name start $(date -u +%H:%M:%S)" >> $D; timeout $limit "$@" > $OUT/call2-$name.txt 2>&1; echo "$name rc=$? end $(date -u +%H:%M:%S)" | tee -a $D; }
# the machine's first process (nothing timed): the split-K op's tests on CUDA
run tests 150 python -m pytest -q -p no:cacheprovider -rfE tests/test_split_k.py
tail -2 $OUT/call2-tests.txt
# down and o added into the residual: cuBLASLt's addmm_ against 2, 4, 8 inner-dimension chunks (36 layers, one graph)
run splitk 120 python -m benchmarks.decode_step --rows 256 128 --live 704 --parts splitk --splits 2 4 8 --blas cublaslt --json $OUT/call2-splitk.json
grep -E "^\| .* down " $OUT/call2-splitk.txt | cut -c1-150
# the whole step under cuBLASLt, the routes' default against down in 2 chunks, A B B A
run step2 120 python -m benchmarks.decode_step --rows 256 128 --live 704 --parts step --down-splits 2 --json $OUT/call2-step2.json
grep -E "^\| (256|128) " $OUT/call2-step2.txt | cut -c1-30,200-300
# the opsd-uniform rollout, the defaults against kernels.down_split_rows=256, interleaved
run rl 150 python -m benchmarks.rl --cells opsd-uniform --candidates auto --twin kernels.down_split_rows=256 --repeats 2 --busy off --json $OUT/call2-rl.json
tail -5 $OUT/call2-rl.txt | cut -c1-250
# the OPSD step at RL scale (uniform and long-tail cells, 3 timed steps each) at the defaults (down_split_rows 0)
run step 300 python -m benchmarks.step --cells uniform,longtail --paths packed --steps 3 --out $OUT/call2-step.json
tail -30 $OUT/call2-step.txt | cut -c1-230
cat $D
