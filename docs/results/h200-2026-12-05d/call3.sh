set -u
# the changed code's CUDA tests: the ordinary executor (static_decode over the parts it is handed), the KV budget,
# the shared-prompt route (padding to a tile edge) and the decode attention
nvidia-smi --query-gpu=name,driver_version --format=csv
timeout 280 python -m pytest -q -p no:cacheprovider -rfE tests/test_fast_decode.py tests/test_memory_budget.py tests/test_ordinary_route.py tests/test_decode_attention.py 2>&1 | tail -8
