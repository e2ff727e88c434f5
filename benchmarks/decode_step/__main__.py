"""``python -m benchmarks.decode_step``: see :mod:`benchmarks.decode_step`."""

from benchmarks.decode_step.cli import main

if __name__ == "__main__":
    main()
