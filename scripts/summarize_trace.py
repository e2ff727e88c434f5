#!/usr/bin/env python
"""Per-stage latency and peak-memory report of torch.profiler traces (see docs/traces.md)."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from traces.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
