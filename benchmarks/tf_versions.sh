#!/usr/bin/env bash
# Builds sntf and runs its smoke tests against several TensorFlow releases,
# each in a fresh virtual environment, to learn which releases the version
# pin in setup.py and requirements.txt may cover.
#
#   bash benchmarks/tf_versions.sh                # TensorFlow 2.19, 2.20, 2.21
#   bash benchmarks/tf_versions.sh 2.20 2.21      # chosen releases
#
# For each release X.Y it copies the working tree (tracked and untracked,
# not ignored files) to $SNTF_TF_VERSIONS_DIR/tfX.Y/src, creates a venv next
# to it, installs tensorflow==X.Y.* with the other requirements (the
# tensorflow line of requirements.txt is left out), builds sntf with
# --no-build-isolation against that TensorFlow, checks that the plugin and
# the op library load, and runs the smoke subset ($SNTF_SMOKE_TESTS). Each
# release's full log is tfX.Y.log in that folder; the last lines printed are
# one verdict per release. The exit status is the number of failed releases.
#
# Environment: SNTF_TF_VERSIONS_DIR (default /tmp/sntf_tf_versions), PYTHON
# (default python3.11), SNTF_SMOKE_TESTS (pytest arguments).
set -uo pipefail
REPO="$(cd "$(dirname "$0")/.." && pwd)"
WORK="${SNTF_TF_VERSIONS_DIR:-/tmp/sntf_tf_versions}"
PYTHON="${PYTHON:-$(command -v python3.11 || command -v python3)}"
SMOKE="${SNTF_SMOKE_TESTS:--m not\ slow tests/test_plugin.py tests/test_pipeline.py tests/test_swap_ops.py tests/test_first_hour.py}"
if [ "$#" -gt 0 ]; then versions=("$@"); else versions=(2.19 2.20 2.21); fi
mkdir -p "$WORK"

verdicts=()
failed=0
for version in "${versions[@]}"; do
  dir="$WORK/tf$version"
  log="$WORK/tf$version.log"
  rm -rf "$dir"
  mkdir -p "$dir/src"
  # The working tree as it is now, without build outputs or the repo's venv.
  (cd "$REPO" && git ls-files -co --exclude-standard -z | tar --null -cf - -T -) \
    | tar -xf - -C "$dir/src"
  step="venv"
  {
    echo "== TensorFlow $version: $(date -u +%FT%TZ), $("$PYTHON" --version 2>&1)"
    "$PYTHON" -m venv "$dir/venv" \
    && step="install" \
    && grep -v -i '^tensorflow' "$dir/src/requirements.txt" > "$dir/requirements-notf.txt" \
    && "$dir/venv/bin/python" -m pip install --quiet --disable-pip-version-check \
         "tensorflow==$version.*" -r "$dir/requirements-notf.txt" \
         pytest "$(grep -i '^hypothesis' "$dir/src/requirements-test.txt")" \
         "$(grep -i '^pytest-timeout' "$dir/src/requirements-test.txt")" \
    && "$dir/venv/bin/python" -c 'import tensorflow as tf, keras; print("installed: TensorFlow", tf.__version__, "Keras", keras.__version__)' \
    && step="build" \
    && (cd "$dir/src" && "$dir/venv/bin/python" -m pip install --quiet \
          --disable-pip-version-check --no-build-isolation --no-deps -e .) \
    && step="load" \
    && (cd "$dir/src" && TF_CPP_MIN_LOG_LEVEL=2 "$dir/venv/bin/python" -c '
import sntf
sntf.enable(policy="off")
print("loaded:", sntf.stats()["plugin"]["registered"])') \
    && step="smoke tests" \
    && (cd "$dir/src" && eval "\"$dir/venv/bin/python\" -m pytest -q -p no:cacheprovider $SMOKE") \
    && step="ok"
  } > "$log" 2>&1
  tf=$("$dir/venv/bin/python" -c 'import tensorflow as tf; print(tf.__version__)' 2>/dev/null || echo "?")
  tail_line=$(grep -E '^[0-9]+ (passed|failed)|passed|failed|error' "$log" | tail -n 1)
  if [ "$step" = "ok" ]; then
    verdicts+=("TensorFlow $version ($tf): ok: $tail_line")
  else
    failed=$((failed + 1))
    verdicts+=("TensorFlow $version ($tf): FAILED at step '$step': ${tail_line:-see $log}")
  fi
  echo "${verdicts[-1]}"
done
echo "---- summary (logs in $WORK)"
printf '%s\n' "${verdicts[@]}"
exit "$failed"
