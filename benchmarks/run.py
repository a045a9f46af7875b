"""The benchmark suite, one command: ``python benchmarks/run.py [--help]`` (from a checkout).

vmcgrad against NetKet and unchunked JAX, every benchmark in one process; the runner is
:mod:`benchlib.suite`, the single benchmarks are the ``bench_*.py`` scripts next to this one.
"""

import sys

from benchlib.suite import main

if __name__ == "__main__":
    sys.exit(main())
