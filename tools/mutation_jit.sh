#!/usr/bin/env bash
# Decides mutants that only numba's compiler can judge (the options of `numba.njit` in
# mindmon/kernels/one_pass.py `_compiled`): with NUMBA_DISABLE_JIT=1, which the mutation tools need, numba
# ignores those options, and with the JIT on it cannot compile mutmut's trampoline. So each mutant's
# diff is applied to a plain copy of the repository and the tests run there with the JIT on.
#
#   tools/mutation_jit.sh NAMES_FILE TEST...      # NAMES_FILE: mutant names, one a line
#
# Environment: MUTATION_DIR (the scratch directory tools/mutation.sh made; default /tmp/mindmon-mutation),
# PYTHON (default: .venv/bin/python when present, else python3). Prints one verdict a mutant.
set -uo pipefail

REPO="$(cd "$(dirname "$0")/.." && pwd)"
PYTHON="${PYTHON:-$([ -x "$REPO/.venv/bin/python" ] && echo "$REPO/.venv/bin/python" || echo python3)}"
SCRATCH="${MUTATION_DIR:-/tmp/mindmon-mutation}"
names="$1"; shift
copy="$SCRATCH/jit-copy"
for name in $(cat "$names"); do
  rm -rf "$copy" && mkdir -p "$copy"
  cp -r "$REPO/mindmon" "$REPO/tests" "$REPO/setup.cfg" "$copy/"
  find "$copy" -name __pycache__ -prune -exec rm -rf {} +
  # `mutmut show` prints a title line, then the diff against the original module
  if ! (cd "$SCRATCH" && "$PYTHON" -m mutmut show "$name") | sed 1d | (cd "$copy" && patch -p0 -s); then
    echo "not applied $name"; continue
  fi
  # a cache directory of its own: no kernel compiled for another mutant is loaded
  (cd "$copy" && NUMBA_CACHE_DIR="$copy/numba-cache" MINDMON_AUTOLOAD=0 PYTHONPATH="$copy" \
     "$PYTHON" -m pytest -x -q -p no:cacheprovider "$@" > "$copy.log" 2>&1)
  status=$?
  case $status in
    0) echo "survived $name" ;;
    1) echo "killed $name ($(grep -m1 -E '^E ' "$copy.log" | cut -c1-100))" ;;
    *) echo "error $name (pytest exit $status; see $copy.log)" ;;
  esac
done
