"""Decode benchmark on bench-s with peers in the same run: `python benchmarks/bench_decode.py [--json]`.

The same as `looplm bench decode`; see looplm/bench/decode.py for what is measured and how.
"""

import sys

from looplm.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", "decode", *sys.argv[1:]]))
