#!/usr/bin/env bash
# GPU call 5: CUDA smoke of the benchmarks package (tiny models where possible), one line of status each.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD
run() { local name=$1; shift; timeout 70 "$@" > $OUT/$name.txt 2>&1; echo "$name rc $?" | tee -a $OUT/rc.txt; tail -4 $OUT/$name.txt; }
run sampler python3 -m benchmarks.sampler --rows 8 --cases greedy "T=1 top-p 0.9" --iters 3 --skip-compiled --json $OUT/sampler.json
run suites python3 -m benchmarks.suites --suite seed004 --model tiny --device cuda --repeats 1 --workloads short-similar,16..512 --json $OUT/suites.json
run rl python3 -m benchmarks.rl --model tiny --device cuda --scale small --cells wide-greedy,longtail-64-1024 --repeats 1 --busy on --json $OUT/rl.json
