"""Pure planning: prompt layout, prefill buckets and their cost model, route choice, the continuous
scheduler, shape buckets and calibration files. Plain data in, decisions out; no torch, testable on the
CPU in milliseconds."""
