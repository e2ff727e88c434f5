"""``python -m benchmarks.rl``: see :mod:`benchmarks.rl`."""

from benchmarks.rl.cli import main

if __name__ == "__main__":
    main()
