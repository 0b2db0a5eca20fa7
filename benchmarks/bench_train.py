"""Training benchmark on bench-s with peers in the same run: `python benchmarks/bench_train.py [--json]`.

The same as `looplm bench train`; see looplm/bench/train.py for what is measured and how.
"""

import sys

from looplm.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", "train", *sys.argv[1:]]))
