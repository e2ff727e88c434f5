# h200-2026-12-06f call 1 (needs an H200: the 3B/3B step peaks at 90 GiB; never ran): 06e call 8 (the CUDA tests of
# the fused rotary in the machine's first process, then the OPSD rollout cells at the defaults against the rotary apart
# and the tuned BLAS), then 06c call 4 on the uniform cell without its RL cell (the tuned BLAS's tests, then the OPSD
# step with the rollout's BLAS as the default and as cublaslt-tuned); LABEL as both need it
set -u
CALL=call1 bash docs/results/h200-2026-12-06e/call8.sh
CALL=call1s CELLS=uniform NO_RL=1 bash docs/results/h200-2026-12-06c/call4.sh
