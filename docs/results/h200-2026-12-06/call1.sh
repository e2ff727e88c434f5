# h200-2026-12-06 call 1: the whole-runs attention (SharedPrefix.whole_runs) timed against today's reads, then
# 2026-12-05d call4.sh's row-cap A/B (opsd-longtail 128 / 0 / 256 rows, opsd-uniform 128 / 0)
# (ran at 45aa351; its whole-run variants were removed again after this call: 658fd5c)
set -u
L=${LABEL:?commit label}
D=$OUT/call1-dates.txt
nvidia-smi --query-gpu=name,driver_version --format=csv > $D
run() { local name=$1 limit=$2; shift 2; echo "$name start $(date -u +%H:%M:%S)" >> $D; timeout $limit "$@" > $OUT/call1-$name.txt 2>&1; echo "$name rc=$? end $(date -u +%H:%M:%S)" | tee -a $D; }
# the machine's first process (nothing timed): the shared-prompt kernels' tests on CUDA
run tests 110 python -m pytest -q -p no:cacheprovider -rfE tests/test_decode_attention.py -k "first_row or route_reading or which_steps or how_an or whole_runs or shared"
tail -2 $OUT/call1-tests.txt
# 36 layers of attention, 4 samples a prompt: each row its own copy, the prefix pass, the first-row reads, whole runs
run shared 120 python -m benchmarks.decode_step --rows 256 128 64 --live 1280 --parts shared --shared-windows 254,704 256,1280 768,1024
grep -E "^\||rows|ms" $OUT/call1-shared.txt | cut -c1-200 | tail -60
run rlopsd 150 python -m benchmarks.rl --cells opsd-longtail --candidates auto --twin kernels.shared_prefix_first_row_rows=0 --twin kernels.shared_prefix_first_row_rows=256 --repeats 3 --busy off --commit-label $L --json $OUT/call1-rlopsd.json
tail -5 $OUT/call1-rlopsd.txt | cut -c1-250
run rl 130 python -m benchmarks.rl --cells opsd-uniform --candidates auto --twin kernels.shared_prefix_first_row_rows=0 --repeats 2 --busy off --commit-label $L --json $OUT/call1-rl.json
tail -4 $OUT/call1-rl.txt | cut -c1-250
cat $D
