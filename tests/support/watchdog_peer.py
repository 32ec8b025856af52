"""One rank of tests/parallel/test_peer_watchdog.py: mindmon's peer watchdog in a process of its own, no MindSpore.

    watchdog_peer.py RANK WORLD HOST PORT SILENCE STEPS

Moves through steps 1..STEPS (as a training loop's events do), prints `at step STEPS`, then waits on stdin: a
line `close` stops the watchdog, `exit` ends without stopping it, `raise` ends on an uncaught exception,
`close in finally` stops it while an exception propagates.
"""
import logging
import sys

from mindmon.core.engine import RunInfo
from mindmon.parallel.watchdog import PeerWatchdog
from mindmon.core.progress import DATA, PROGRESS


def main(rank: int, world: int, host: str, port: int, silence: float, steps: int) -> None:
    logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="%(levelname)s %(message)s")
    watchdog = PeerWatchdog(rank, world, (host, port), logging.getLogger("mindmon"), silence=silence)
    watchdog.start(RunInfo(rank))
    for step in range(1, steps + 1):
        PROGRESS.enter(step + 1, DATA)   # step `step` written
    print(f"at step {steps}", flush=True)
    command = sys.stdin.readline().strip()
    if command == "close":
        watchdog.stop()
        print("closed", flush=True)
    elif command == "raise":
        raise RuntimeError("this rank failed")
    elif command == "close in finally":
        try:
            raise RuntimeError("this rank failed")
        finally:
            watchdog.stop()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], int(sys.argv[4]), float(sys.argv[5]), int(sys.argv[6]))
