#!/usr/bin/env bash
# Mutation testing of mindmon's numeric core with mutmut: on demand, never in CI (each mutant reruns
# the tests that reach the mutated function; on two cores the default set takes hours).
#
#   tools/mutation.sh                                   # the whole numeric core
#   tools/mutation.sh mindmon/kernels/stats.py mindmon/features/train_state/monitor.py
#
# Runs in a scratch copy ($MUTATION_DIR, default /tmp/mindmon-mutation), so the working tree is never
# touched; prints the surviving mutants and the kill rate. Inspect a survivor with
#   cd $MUTATION_DIR && $PYTHON -m mutmut show <mutant name>
# Environment: PYTHON (default: .venv/bin/python when present, else python3), JOBS (parallel mutants,
# default 2), MUTATION_DIR, MUTATION_TESTS (test files to run instead of the ones listed below, e.g. the
# fast ones first, the Trainer tests on the survivors only). Needs the `mutation` extra: pip install -e ".[mutation]".
set -euo pipefail

REPO="$(cd "$(dirname "$0")/.." && pwd)"
PYTHON="${PYTHON:-$([ -x "$REPO/.venv/bin/python" ] && echo "$REPO/.venv/bin/python" || echo python3)}"
JOBS="${JOBS:-2}"
SCRATCH="${MUTATION_DIR:-/tmp/mindmon-mutation}"

# The fast test files that check each module's numbers (the msrun test for distributed.py is slow).
tests_for() {
  case "$1" in
    mindmon/kernels/stats.py) echo "tests/kernels/test_stats.py tests/kernels/test_direct_view.py tests/features/train_state/test_train_state_values.py tests/loop/test_plain_loop.py tests/loop/test_step_paths.py" ;;
    mindmon/loop/step.py) echo "tests/features/train_state/test_train_state_values.py tests/loop/test_plain_loop.py tests/core/test_step_values.py tests/kernels/test_stats.py tests/loop/test_step_paths.py" ;;
    mindmon/features/train_state/monitor.py) echo "tests/features/train_state/test_train_state_values.py" ;;
    mindmon/features/moe_tokens/monitor.py) echo "tests/features/moe_tokens/test_moe_tokens_values.py tests/features/moe_tokens/test_moe_tokens.py tests/probes/test_probes.py" ;;
    mindmon/kernels/one_pass.py|mindmon/kernels/compiled.py) echo "tests/kernels/test_one_pass.py tests/features/tensor_stats/test_tensor_stats_ops.py" ;;
    mindmon/features/tensor_stats/monitor.py) echo "tests/features/tensor_stats/test_tensor_stats_ops.py tests/kernels/test_one_pass.py tests/features/tensor_stats/test_tensor_stats_engine.py tests/kernels/test_direct_view.py tests/msprobe/test_msprobe_trainer_mon.py" ;;
    mindmon/compat.py) echo "tests/core/test_compat.py tests/msprobe/test_msprobe_csv.py" ;;
    mindmon/features/tensor_stats/accumulate.py) echo "tests/features/tensor_stats/test_tensor_stats_gradient_sums.py tests/msprobe/test_msprobe_trainer_mon.py tests/kernels/test_direct_view.py tests/msprobe/test_msprobe_dynamic_on_off.py" ;;
    mindmon/features/tensor_stats/activations.py) echo "tests/features/tensor_stats/test_tensor_stats_activations.py tests/features/tensor_stats/test_tensor_stats_activations_yaml.py" ;;
    mindmon/formats/msprobe_csv.py) echo "tests/msprobe/test_msprobe_csv.py tests/msprobe/test_msprobe_trainer_mon.py tests/features/tensor_stats/test_tensor_stats_activations.py" ;;
    mindmon/features/max_logits/monitor.py) echo "tests/features/max_logits/test_max_logits_monitor.py tests/features/max_logits/test_max_logits.py tests/probes/test_probes.py" ;;
    mindmon/parallel/data_parallel.py) echo "tests/parallel/test_data_parallel.py" ;;
    mindmon/features/max_logits/probe.py) echo "tests/features/max_logits/test_max_logits_probe_values.py tests/features/max_logits/test_max_logits_probes_gqa.py tests/probes/test_probes.py" ;;
    mindmon/features/moe_tokens/probe.py) echo "tests/probes/test_probes_details.py tests/probes/test_probes.py tests/features/max_logits/test_max_logits_probes_gqa.py" ;;
    *) echo "tools/mutation.sh: no test files known for $1; add it to tests_for" >&2; exit 2 ;;
  esac
}

cd "$REPO"
if [ "$#" -eq 0 ]; then
  set -- mindmon/kernels/stats.py mindmon/loop/step.py mindmon/parallel/data_parallel.py mindmon/features/train_state/monitor.py \
    mindmon/features/moe_tokens/monitor.py mindmon/features/max_logits/monitor.py mindmon/features/max_logits/probe.py \
    mindmon/features/moe_tokens/probe.py
fi
modules=() tests=()
for module in "$@"; do
  [ -f "$module" ] || { echo "tools/mutation.sh: $module: no such file" >&2; exit 2; }
  modules+=("$module")
  # numba cannot compile mutmut's trampoline; with the JIT off njit returns it and it runs as Python
  case "$module" in mindmon/kernels/one_pass.py|mindmon/kernels/compiled.py) export NUMBA_DISABLE_JIT=1 ;; esac
  module_tests="$(tests_for "$module")"   # an unknown module stops the script here
  module_tests="${MUTATION_TESTS:-$module_tests}"
  for t in $module_tests; do
    [[ " ${tests[*]-} " == *" $t "* ]] || tests+=("$t")
  done
done

rm -rf "$SCRATCH" && mkdir -p "$SCRATCH"
cp -r mindmon tests configs setup.cfg "$SCRATCH/"
find "$SCRATCH" -name __pycache__ -prune -exec rm -rf {} +
# MINDMON_AUTOLOAD=0 (below) keeps the installed mindmon out at interpreter start; the tests that train
# with the MindFormers Trainer need the (mutated) copy attached instead, from the scratch conftest.
cat >> "$SCRATCH/tests/conftest.py" <<'CONFTEST'


def _attach_the_mutated_mindmon():
    from mindmon.integrations import autoload
    os.environ.pop("MINDMON_AUTOLOAD", None)
    autoload.install()
    os.environ["MINDMON_AUTOLOAD"] = "0"


_attach_the_mutated_mindmon()
CONFTEST
{
  printf '\n[mutmut]\nsource_paths = mindmon\nonly_mutate =\n'
  printf '    %s\n' "${modules[@]}"
  printf 'pytest_add_cli_args_test_selection =\n'
  printf '    %s\n' "${tests[@]}"
  printf 'pytest_add_cli_args =\n    -p\n    no:cacheprovider\n'
  # MindSpore's thread pools do not survive fork() from a process that ran ops: mutants forked from
  # mutmut's main process hang (false "timeout" kills). Fork instead from a server that imported
  # nothing, so every mutant imports MindSpore afresh (a few seconds each, but every verdict is real).
  printf 'process_isolation = forkserver\nforkserver_warmup = none\n'
  # mutmut's time limit is 15 x (the tests' own durations + timeout_constant); those durations leave
  # out the import above, which takes a minute on loaded cores: with the default constant of 1 s a
  # mutant whose tests last 1 s "times out" after 30 s and counts as killed without a verdict.
  printf 'timeout_constant = 20\n'
} >> "$SCRATCH/setup.cfg"

cd "$SCRATCH"
# mutmut puts mutants/ first on sys.path; an installed mindmon must not be imported before that,
# which its autoload .pth would do at interpreter start
export MINDMON_AUTOLOAD=0
echo "mutating: ${modules[*]}"
echo "tests:    ${tests[*]}"
"$PYTHON" -m mutmut run --max-children "$JOBS" || true
"$PYTHON" -m mutmut results || true
"$PYTHON" -m mutmut export-cicd-stats >/dev/null
"$PYTHON" - <<'EOF'
import json

stats = json.load(open("mutants/mutmut-cicd-stats.json"))
tested = stats["total"] - stats.get("skipped", 0) - stats.get("not_checked", 0)
caught = stats["killed"] + stats.get("timeout", 0) + stats.get("segfault", 0)
print(f"mutants: {stats['total']}, killed: {stats['killed']}, timeout: {stats.get('timeout', 0)}, "
      f"survived: {stats['survived']}, no tests: {stats.get('no_tests', 0)}")
print(f"kill rate: {100.0 * caught / max(tested, 1):.1f}% of {tested}")
EOF
