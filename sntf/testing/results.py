"""The benchmarks' JSON-lines results files: one JSON object per line,
appended as runs finish, so that a sweep resumes from its file."""

from __future__ import annotations

import json
import os
from typing import Callable


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


def table_or_sweep(show_table: bool, path: str, table: Callable[[list], str],
                   sweep: Callable[[], int]) -> int:
    """A sweep script's main: print the table of its results file, or run
    the sweep.

    Args:
      show_table: print the table (the script's --table flag).
      path: the results file.
      table: rows -> the markdown table.
      sweep: runs what is left of the sweep; returns the exit status.

    Returns:
      The exit status.
    """
    if show_table:
        print(table(load(path)))
        return 0
    return sweep()
