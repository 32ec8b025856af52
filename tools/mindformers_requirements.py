"""Print the installed MindFormers' own requirements, one a line, without those this environment cannot or
must not take from them: hyper-parallel (no package registry serves it; the tests use a single-device
stand-in, tests/support/hyper_parallel_standin) and mindspore (pinned by the constraints file).
Used by `make install-ms210` after `pip install --no-deps mindformers`."""
import re
from importlib.metadata import requires

LEFT_OUT = {"hyper-parallel", "hyper_parallel", "mindspore"}


def main() -> None:
    for requirement in requires("mindformers") or []:
        name = re.split(r"[<>=~!;\[ ]", requirement, maxsplit=1)[0].strip().lower()
        if name not in LEFT_OUT and "extra ==" not in requirement:
            print(requirement)


if __name__ == "__main__":
    main()
