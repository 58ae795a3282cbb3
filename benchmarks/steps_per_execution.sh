#!/usr/bin/env bash
# A training step inside Keras' steps_per_execution loop, with and without
# sntf: the ResNet family at batch 32, steps_per_execution=4, 8 steps (two
# calls of the loop), each configuration in a fresh process, at oneDNN on
# with the default inter-op pool and with one inter-op thread, three
# repeats each. Prints one line per run (setting, policy, repeat, CPU:0 peak
# in bytes, losses, training reports) and the weights' comparison.
#
#     bash benchmarks/steps_per_execution.sh [repeats]
set -euo pipefail
cd "$(dirname "$0")/.."
repeats="${1:-3}"
out="$(mktemp -d)"
trap 'rm -rf "$out"' EXIT
export TF_CPU_ALLOCATOR_USE_BFC=true TF_ENABLE_ONEDNN_OPTS=1
for setting in default one; do
  for rep in $(seq "$repeats"); do
    for policy in none recompute swap+recompute; do
      flags=()
      [ "$policy" != none ] && flags=(--sntf "$policy")
      if [ "$setting" = one ]; then export TF_NUM_INTEROP_THREADS=1
      else unset TF_NUM_INTEROP_THREADS; fi
      .venv/bin/python sntf/testing/workers/train_keras.py --family resnet \
          --steps 8 --batch 32 --steps-per-execution 4 "${flags[@]}" \
          --out "$out/$setting-$policy-$rep.npz" 2>/dev/null \
        | grep '^RESULT' | SETTING="$setting" POLICY="$policy" REP="$rep" \
          .venv/bin/python -c '
import json, os, sys
r = json.loads(sys.stdin.read()[len("RESULT "):])
runs = [(x["action"], len(x["swapped"] or []), len(x["recomputed"] or []),
         x["planned_peak_bytes"]) for x in (r["reports"] or []) if x["training"]]
print(os.environ["SETTING"], os.environ["POLICY"], os.environ["REP"],
      r["peak_bytes"], r["losses"], runs)'
    done
  done
done
OUT="$out" .venv/bin/python - <<'EOF'
import glob, os
import numpy as np
for path in sorted(glob.glob(os.path.join(os.environ["OUT"], "*-none-*.npz"))):
    base = np.load(path)
    for policy in ("recompute", "swap+recompute"):
        other = np.load(path.replace("-none-", f"-{policy}-"))
        same = all(base[k].tobytes() == other[k].tobytes() for k in base)
        print(os.path.basename(path), policy, "weights identical" if same else "WEIGHTS DIFFER")
EOF
