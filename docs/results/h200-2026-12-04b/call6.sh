set -u
D=$OUT/call6-dates.txt
nvidia-smi --query-gpu=name,driver_version --format=csv > $D
echo "tests start $(date -u +%H:%M:%S)" >> $D
# every GPU test on 60a73f2 (the residual in place and the plain draw by default); nothing timed
timeout 440 python -m pytest -m gpu -q -p no:cacheprovider -rfE tests > $OUT/call6-tests.txt 2>&1
echo "tests rc=$? end $(date -u +%H:%M:%S)" | tee -a $D
tail -15 $OUT/call6-tests.txt
