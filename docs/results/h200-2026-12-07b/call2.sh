# h200-2026-12-07b call 2 (any card; after call 1 on the same machine): the rollout cells in the two trees'
# alternating processes, new (this tree, snap/: longest prompts first), old (OLD, ../snapold: request order), order
# new old old new, `python -m benchmarks.rl --cells <cell> --candidates auto --repeats 1 --busy off`; then one profiled
# opsd-uniform call in the new tree (OPSD_PROFILE=1), its kernels summed per decode step (07's kernels_of_trace.py)
set -u
L=${LABEL:?commit label}
OLD=${OLD:?old tree label}
C=${CALL:-call2}
D=$OUT/$C-dates.txt
nvidia-smi --query-gpu=name,driver_version --format=csv > $D
for cell in ${CELLS:-opsd-uniform opsd-longtail}; do
  for tree in new old old new; do
    if [ $tree = new ]; then dir=$PWD; label=$L; else dir=$PWD/../snapold; label=$OLD; fi
    f=$OUT/$C-$cell-$tree-$(date -u +%H%M%S).txt
    echo "$cell $tree start $(date -u +%H:%M:%S)" >> $D
    (cd $dir && PYTHONPATH=/tmp/site:$dir timeout 100 python -m benchmarks.rl --cells $cell --candidates auto --repeats 1 --busy off --commit-label $label > $f 2>&1)
    echo "$cell $tree rc=$? end $(date -u +%H:%M:%S)" | tee -a $D
    grep -E "^\| [0-9a-f]{7} " $f | cut -c1-200
  done
done
if [ -z "${NO_PROFILE:-}" ]; then
  mkdir -p /tmp/tr && rm -f /tmp/tr/*.json
  echo "profiled start $(date -u +%H:%M:%S)" >> $D
  OPSD_PROFILE=1 timeout 150 python -m benchmarks.rl --cells opsd-uniform --candidates auto --repeats 2 --busy on --trace-dir /tmp/tr --commit-label $L --json $OUT/$C-rl.json > $OUT/$C-rl.txt 2>&1
  echo "profiled rc=$? end $(date -u +%H:%M:%S)" | tee -a $D
  grep -E "^\| [0-9a-f]{7} " $OUT/$C-rl.txt | cut -c1-250
  T=$(ls /tmp/tr/*.json | head -1)
  timeout 90 python docs/results/h200-2026-12-07/kernels_of_trace.py $T 1024 30 > $OUT/$C-kernels.txt 2>&1
  head -14 $OUT/$C-kernels.txt | cut -c1-200
fi
cat $D
