"""The random-weight GGUF writer of the benchmarks (benchmarks/random_gguf.py), which makes the tests' GGUF models and
blocks too: one writer for both."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[1] / "benchmarks"))

from random_gguf import SCALES, random_blocks, write

__all__ = ["SCALES", "random_blocks", "write"]
