"""Fuzzes sntf's graph pass with random training graphs; see sntf/testing/fuzz.py.

    python benchmarks/fuzz_pass.py --cases 1000 --seed 0
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from sntf.testing.fuzz import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
