"""One rank of tests/test_peer_watchdog.py: mindmon's peer watchdog in a process of its own, no MindSpore.

    watchdog_peer.py RANK WORLD HOST PORT SILENCE STEPS

Writes steps 1..STEPS (one record each) to the watchdog, prints `at step STEPS`, then waits on stdin: a
line `close` closes the watchdog, `exit` ends without closing it, `raise` ends on an uncaught exception,
`close in finally` closes it while an exception propagates.
"""
import logging
import sys

from mindmon.engine import RunInfo
from mindmon.parallel.watchdog import PeerWatchdog
from mindmon.records import Record


def main(rank: int, world: int, host: str, port: int, silence: float, steps: int) -> None:
    logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="%(levelname)s %(message)s")
    watchdog = PeerWatchdog(rank, world, (host, port), logging.getLogger("mindmon"), silence=silence)
    watchdog.open(RunInfo(rank))
    for step in range(1, steps + 1):
        watchdog.write([Record(step, None, rank, "loss", "loss", 1.0)])
    print(f"at step {steps}", flush=True)
    command = sys.stdin.readline().strip()
    if command == "close":
        watchdog.close()
        print("closed", flush=True)
    elif command == "raise":
        raise RuntimeError("this rank failed")
    elif command == "close in finally":
        try:
            raise RuntimeError("this rank failed")
        finally:
            watchdog.close()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], int(sys.argv[4]), float(sys.argv[5]), int(sys.argv[6]))
