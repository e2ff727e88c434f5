#!/usr/bin/env bash
# GPU call 2: the new code's GPU tests (the machine's first process), then old (9e62fec) and new in alternating
# processes on one harness (docs/results/h200-2026-12-02f/ab_rollout.py).
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export MASTER_ADDR=127.0.0.1 MASTER_PORT=29500 RANK=0 WORLD_SIZE=1 LOCAL_RANK=0
AB=$PWD/docs/results/h200-2026-12-02f/ab_rollout.py
{ date -u; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; PYTHONPATH=/tmp/site python3 -c "import torch, transformers, triton; print(torch.__version__, torch.version.cuda, transformers.__version__, triton.__version__)"; git rev-parse HEAD 2>/dev/null; } > $OUT/env.txt 2>&1
PYTHONPATH=/tmp/site:$PWD timeout 300 python3 -m pytest -q -p no:cacheprovider tests -m gpu > $OUT/gputests.txt 2>&1; echo "rc $?" >> $OUT/gputests.txt
tail -3 $OUT/gputests.txt
for label in ${ORDER:-old new}; do
  if [ $label = old ]; then tree=$PWD/ab_old; else tree=$PWD; fi
  (cd $tree && PYTHONPATH=/tmp/site:$tree timeout 130 python3 $AB --label $label >> $OUT/ab.jsonl 2>> $OUT/ab-$label.err; echo "$label rc $?" >> $OUT/ab-rc.txt)
done
cat $OUT/ab-rc.txt; python3 - <<'PY'
import json, os, statistics
rows = [json.loads(l) for l in open(os.environ["OUT"] + "/ab.jsonl")]
for r in rows:
    print(r["label"], " ".join(f'{k} {statistics.mean(v["walls_ms"]):.1f}' for k, v in r["rows"].items()))
PY
