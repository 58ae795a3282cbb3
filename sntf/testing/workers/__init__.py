"""Worker scripts: each trains in a fresh process and prints one RESULT line.

Run by path (`python sntf/testing/workers/measure_peak.py ...`), so that a
baseline process never imports the sntf package; the benchmarks and tests
also import their helpers.
"""
