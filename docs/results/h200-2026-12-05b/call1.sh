set -u
D=$OUT/call1-dates.txt
nvidia-smi --query-gpu=name,driver_version --format=csv > $D
python -c "import torch, transformers, triton; print(torch.__version__, torch.version.cuda, transformers.__version__, triton.__version__)" >> $D
run() { local name=$1 limit=$2; shift 2; echo "$name start $(date -u +%H:%M:%S)" >> $D; timeout $limit "$@" > $OUT/call1-$name.txt 2>&1; echo "$name rc=$? end $(date -u +%H:%M:%S)" | tee -a $D; }
# the machine's first process (nothing timed): the split-K op's tests and the decode-step benchmark's, on CUDA
run tests 150 python -m pytest -q -p no:cacheprovider -rfE tests/test_split_k.py tests/test_benchmarks_decode_step.py
tail -3 $OUT/call1-tests.txt
# down and o added into the residual: cuBLAS's addmm_ against 2, 4, 8 inner-dimension chunks (36 layers, one graph)
run splitk 200 python -m benchmarks.decode_step --rows 256 128 --live 704 --parts splitk --splits 2 4 8 --blas cublaslt cublas --json $OUT/call1-splitk.json
grep -E "^\| " $OUT/call1-splitk.txt | cut -c1-170
# the whole step, the routes' default against the same with down in 4 (then 2) chunks, A B B A
run step4 120 python -m benchmarks.decode_step --rows 256 128 --live 704 --parts step --down-splits 4 --json $OUT/call1-step4.json
grep -E "^\| (256|128) " $OUT/call1-step4.txt | cut -c1-40,200-300
run step2 120 python -m benchmarks.decode_step --rows 256 --live 704 --parts step --down-splits 2 --json $OUT/call1-step2.json
grep -E "^\| 256 " $OUT/call1-step2.txt | cut -c1-40,200-300
# the OPSD step at RL scale (uniform and long-tail cells, 3 timed steps each) on d47391a's code (the release fix)
run step 300 python -m benchmarks.step --cells uniform,longtail --paths packed --steps 3 --out $OUT/call1-step.json
tail -30 $OUT/call1-step.txt | cut -c1-230
cat $D
