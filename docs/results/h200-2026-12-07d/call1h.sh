# h200-2026-12-07d call 1h (an H100 is enough: no OPSD step). The shared-prompt table of BENCHMARKS section 1 again,
# now that keys and values are stored as a new cache is (storage_columns: 1,280 -> 1,344 wide), and opsd-uniform with
# the first-row reads at 256 rows (the H100's cap before 604431e) against the default cap of 128 in one process.
# The machine's first process (nothing timed): the storage, padding and first-row tests on CUDA.
set -u
L=${LABEL:?commit label}
C=${CALL:-call1h}
D=$OUT/$C-dates.txt
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > $D
run() { local name=$1 limit=$2; shift 2; echo "$name start $(date -u +%H:%M:%S)" >> $D; timeout $limit "$@" > $OUT/$C-$name.txt 2>&1; echo "$name rc=$? end $(date -u +%H:%M:%S)" | tee -a $D; }
run tests 80 python -m pytest -q -p no:cacheprovider tests/test_kv_storage.py tests/test_decode_attention.py -k "storage or padding or first_row or shared"
tail -1 $OUT/$C-tests.txt
run shared 120 python -m benchmarks.decode_step --rows 256 128 64 --live 1280 --parts shared --shared-windows 254,704 256,704 768,1024 --json $OUT/$C-shared.json
grep -E "^\|" $OUT/$C-shared.txt | cut -c1-220 | tail -20
run rl 150 python -m benchmarks.rl --cells opsd-uniform --candidates auto --twin "kernels.shared_prefix_first_row_rows=256" --repeats 2 --busy off --commit-label $L --json $OUT/$C-rl.json
grep -E "^\| [0-9a-f]{7} " $OUT/$C-rl.txt | cut -c1-250
cat $D
