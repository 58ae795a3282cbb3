#!/usr/bin/env bash
# Sets up everything sntf needs on a machine with Python 3.11 and g++:
# a virtual environment in .venv, the pinned dependencies (sntf's and its
# tests'), and sntf itself, compiled against the TensorFlow installed in
# that environment, with its startup hook (sntf-startup.pth in
# site-packages: SNTF_POLICY/SNTF_BUDGET work without `import sntf`).
#
#   bash tools/bootstrap.sh
#
# Safe to run again: it reuses .venv and skips the native build when the
# compiled libraries are newer than their sources.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON="${PYTHON:-$(command -v python3.11 || command -v python3)}"
if [ ! -x .venv/bin/python ]; then
  echo "sntf bootstrap: creating .venv with $("$PYTHON" --version 2>&1)"
  "$PYTHON" -m venv .venv
fi
VPY=.venv/bin/python
"$VPY" - <<'PY'
import sys
if sys.version_info < (3, 10):
    sys.exit(f"sntf needs Python >= 3.10 (3.11 recommended), found {sys.version.split()[0]}")
PY

echo "sntf bootstrap: installing dependencies (TensorFlow is large the first time)"
"$VPY" -m pip install --quiet --disable-pip-version-check -r requirements-test.txt

built_and_current() {
  local lib
  for pattern in _sntf_ops _plugin _bfc_model _graph_walks; do
    lib=$(ls sntf/$pattern*.so 2>/dev/null | head -n1) || true
    [ -n "$lib" ] || return 1
    # Rebuild when any native source or the build script is newer.
    [ -z "$(find tf_ops setup.py -newer "$lib" -print -quit)" ] || return 1
  done
  "$VPY" -m pip show --quiet sntf >/dev/null 2>&1 || return 1
  # An environment set up before sntf had its startup hook lacks it.
  "$VPY" -c 'import os, sysconfig, sys; sys.exit(not os.path.isfile(os.path.join(sysconfig.get_paths()["purelib"], "sntf-startup.pth")))' || return 1
}

if built_and_current; then
  echo "sntf bootstrap: native libraries are up to date"
else
  echo "sntf bootstrap: building sntf against the installed TensorFlow"
  # No build isolation: the libraries must link the TensorFlow in .venv, and
  # isolation would download TensorFlow a second time.
  "$VPY" -m pip install --quiet --disable-pip-version-check \
    --no-build-isolation --no-deps -e .
fi
"$VPY" -c 'import os, sysconfig, sys
path = os.path.join(sysconfig.get_paths()["purelib"], "sntf-startup.pth")
sys.exit(None if os.path.isfile(path) else "sntf bootstrap: the install left no " + path)'
echo "sntf bootstrap: ready ($("$VPY" -c 'import tensorflow as tf; print("TensorFlow", tf.__version__)' 2>/dev/null))"
