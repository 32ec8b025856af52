"""Recheck mutants of a finished or interrupted tools/mutation.sh run in one process, a second or two each.

mutmut imports MindSpore afresh for every mutant (see tools/mutation.sh), which takes minutes per
dozen mutants on loaded cores. Its trampolines read MUTANT_UNDER_TEST at every call, so one process
that imported everything once can switch mutants between pytest runs: each mutant runs the given test
files with -x and counts as killed when they fail. Run inside the scratch copy's mutants directory:

    cd $MUTATION_DIR/mutants
    MINDMON_AUTOLOAD=0 python /path/to/tools/mutation_recheck.py --all-of mindmon/probes/max_logits.py \\
        tests/test_max_logit_probe_values.py tests/test_probes_gqa.py > recheck.txt
    grep PASSED recheck.txt | awk '{print $2}' | MINDMON_AUTOLOAD=0 python .../mutation_recheck.py tests/...

The first line checks the unmutated code, which must pass. A test that leaves state behind (a
registered hook on a shared object) could make later verdicts differ from mutmut's fresh processes:
confirm a survivor or a surprising kill with `MUTANT_UNDER_TEST=<name> python -m pytest ...`.
"""
import argparse
import contextlib
import io
import json
import os
import sys


def mutant_names(arguments) -> list:
    if arguments.all_of:
        with open(f"{arguments.all_of}.meta") as meta:
            return list(json.load(meta)["exit_code_by_key"])
    return [line.strip() for line in sys.stdin if line.strip()]


def run(test_files: list, mutant: str) -> str:
    import pytest

    os.environ["MUTANT_UNDER_TEST"] = mutant
    output = io.StringIO()
    with contextlib.redirect_stdout(output):
        exit_code = pytest.main(["-x", "-q", "-p", "no:cacheprovider", *test_files])
    summary = [line for line in output.getvalue().splitlines() if line.strip()][-1:]
    return f"{'KILLED' if exit_code else 'PASSED'} {mutant or '(unmutated)'} {summary}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--all-of", help="a mutated module: every mutant listed in its .meta file")
    parser.add_argument("tests", nargs="+", help="test files or node ids")
    arguments = parser.parse_args()
    sys.path.insert(0, os.getcwd())   # the mutated copy, not an installed mindmon
    for mutant in [""] + mutant_names(arguments):
        print(run(arguments.tests, mutant), flush=True)


if __name__ == "__main__":
    main()
