"""Command-line tools that ship with sntf (run them with `python -m sntf.tools.<name>`).

  dump   trains a model for a step with sntf and writes every training graph,
         its plan and its predicted memory timeline to a folder
         (installed as the `sntf-dump` command; `tools/sntf_dump` in a clone).
"""
