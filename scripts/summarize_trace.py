#!/usr/bin/env python
"""Per-stage latency and peak-memory report of torch.profiler traces (see docs/traces.md)."""

import sys

from traces.cli import main

if __name__ == "__main__":
    sys.exit(main())
