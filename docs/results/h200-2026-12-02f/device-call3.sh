#!/usr/bin/env bash
# GPU call 3: a throwaway first process, then new and old in the reverse order of call 2, 5 timed calls each.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
AB=$PWD/docs/results/h200-2026-12-02f/ab_rollout.py
PYTHONPATH=/tmp/site:$PWD timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_blas.py -m gpu > $OUT/warmup.txt 2>&1; tail -1 $OUT/warmup.txt
for label in new old; do
  if [ $label = old ]; then tree=$PWD/ab_old; else tree=$PWD; fi
  (cd $tree && PYTHONPATH=/tmp/site:$tree timeout 170 python3 $AB --label $label --repeats 5 >> $OUT/ab.jsonl 2>> $OUT/ab-$label.err; echo "$label rc $?" >> $OUT/ab-rc.txt)
done
cat $OUT/ab-rc.txt; python3 - <<'PY'
import json, os, statistics
for l in open(os.environ["OUT"] + "/ab.jsonl"):
    r = json.loads(l)
    print(r["label"], " ".join(f'{k} {statistics.median(v["walls_ms"]):.1f}' for k, v in r["rows"].items()))
PY
