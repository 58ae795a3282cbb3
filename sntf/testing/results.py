"""The benchmarks' JSON-lines results files: one JSON object per line,
appended as runs finish, so that a sweep resumes from its file."""

from __future__ import annotations

import json
import os


def load(path: str) -> list:
    """The rows of a results file ([] where it does not exist yet).

    Args:
      path: the file.

    Returns:
      One dict per non-blank line, in file order.
    """
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]
