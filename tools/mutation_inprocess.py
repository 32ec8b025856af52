"""Runs mutmut's mutants of one module inside one Python process (after tools/mutation.sh made them).

tools/mutation.sh starts a fresh process per mutant, which imports MindSpore each time: 10 to 30 s per
mutant on loaded cores, hours for a module. mutmut's trampoline reads MUTANT_UNDER_TEST at every call,
so one process can run the tests of many mutants in turn, paying the import once:

    cd $MUTATION_DIR/mutants && MINDMON_AUTOLOAD=0 python /path/to/tools/mutation_inprocess.py \\
        mindmon.kernels.stats verdicts.json [--status None,0,33] [--extra FUNCTION=TEST ...]

For every mutant of the module whose mutmut exit code is in --status (default: not run yet, survived,
no tests), or named in --names FILE (one a line), it runs `pytest -x` on the tests mutmut mapped to
the mutated function, plus --extra tests for one function (`x__host_array=tests/kernels/test_direct_view.py`,
the function named as in the mutant names) and --every TEST for all, fast unit files first. A failure
counts as a kill only if the failing test then passes unmutated in the same process (else the mutant
left state behind: "suspect"). Confirm survivors in a fresh process:
`MUTANT_UNDER_TEST=<name> python -m pytest <tests>`.
"""
import argparse
import contextlib
import io
import json
import os
import signal
import sys
from typing import Dict, List

import pytest

TIMEOUT_S = 300   # a mutant that loops: counted as caught, as mutmut counts its timeouts


class _FailedTests:
    """pytest plugin: the node ids of the tests that failed."""

    def __init__(self):
        self.nodes: List[str] = []

    def pytest_runtest_logreport(self, report):
        if report.failed:
            self.nodes.append(report.nodeid)


def _raise_timeout(signum, frame):
    raise TimeoutError("the mutant's tests took longer than %d s" % TIMEOUT_S)


def run_tests(mutant: str, nodes: List[str]):
    """(pytest exit code or 'timeout', failed node ids) with `mutant` active ('' = the original code)."""
    os.environ["MUTANT_UNDER_TEST"] = mutant
    failed, output = _FailedTests(), io.StringIO()
    signal.alarm(TIMEOUT_S)
    try:
        with contextlib.redirect_stdout(output), contextlib.redirect_stderr(output):
            code = pytest.main(["--rootdir=.", "-x", "-q", "-p", "no:cacheprovider", *nodes], plugins=[failed])
    except TimeoutError:
        code = "timeout"
    finally:
        signal.alarm(0)
    return code, failed.nodes


def fast_first(nodes) -> List[str]:
    """Unit-level files (no training run) first, so that most kills cost a second."""
    training = ("test_plain_loop", "test_train_state_values", "test_moe_tokens.py", "test_probes.py")
    return sorted(set(nodes), key=lambda node: (any(t in node for t in training), node))


def verdict(mutant: str, nodes: List[str]) -> str:
    if not nodes:
        return "no tests"
    code, failed = run_tests(mutant, nodes)
    if code == 0 or code == "timeout":
        return "survived" if code == 0 else "timeout"
    clean, _ = run_tests("", failed[:1] or nodes)
    return "killed" if clean == 0 else f"suspect (mutant exit {code}, original exit {clean})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("module"), parser.add_argument("verdicts")
    parser.add_argument("--status", default="None,0,33")
    parser.add_argument("--names", help="a file of mutant names, one a line, to run instead (e.g. survivors)")
    parser.add_argument("--extra", action="append", default=[])
    parser.add_argument("--every", action="append", default=[], help="a test run for every mutant")
    args = parser.parse_args()
    sys.path.insert(0, os.getcwd())   # the mutated copy, as mutmut runs it
    signal.signal(signal.SIGALRM, _raise_timeout)
    exit_codes = json.load(open(args.module.replace(".", "/") + ".py.meta"))["exit_code_by_key"]
    tests_of = json.load(open("mutmut-stats.json"))["tests_by_mangled_function_name"]
    extras: Dict[str, List[str]] = {}
    for item in args.extra:
        function, node = item.split("=", 1)
        extras.setdefault(function, []).append(node)
    wanted = set(args.status.split(","))
    names = set(open(args.names).read().split()) if args.names else None
    verdicts = {}
    for mutant, code in exit_codes.items():
        if (mutant in names) if names is not None else (str(code) in wanted):
            function = mutant.rsplit(".", 1)[1].rsplit("__mutmut_", 1)[0]
            mapped = list(tests_of.get(f"{args.module}.{function}", []))
            nodes = fast_first(mapped + extras.get(function, []) + args.every)
            verdicts[mutant] = verdict(mutant, nodes)
            print(verdicts[mutant], mutant, flush=True)
            json.dump(verdicts, open(args.verdicts, "w"), indent=1)
    counts = {v: list(verdicts.values()).count(v) for v in sorted(set(verdicts.values()))}
    print(f"in-process verdicts of {len(verdicts)} mutants: {counts}")


if __name__ == "__main__":
    main()
