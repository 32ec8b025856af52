"""Run events for the recipients: the run started, finished or crashed, a rank was lost, the ranks
hang, one rank is slow. An event is handed to `AlertSink.report_event` (or one of its named
helpers) by whoever observed it (a front door, the peer watchdog, the speed monitor) and travels to
each recipient whose `events` names its kind, as an `Anomaly` with `details`, through the same
buffer, spool and retries as the anomalies.

Example:
    details = started_details(monitored=["train_state", "alert"], layout="dp 2 x tp 2", hosts=["n1", "n2"])
    event_message("started", 0, 0, details)
    # 'run started: monitoring train_state, alert; layout dp 2 x tp 2; hosts n1, n2; mindmon 0.3.0, ...'
"""
import os
import socket
import sys
import traceback
from datetime import datetime, timezone
from typing import Any, Dict, List, Optional, Sequence

from mindmon.features.alerts.inform import EVENT_KINDS

TITLES = {"started": "run started", "finished": "run finished", "crashed": "run crashed",
          "rank_lost": "rank lost", "hang": "hang", "slow_rank": "slow rank", "throughput_drop": "throughput drop"}
# the statistic of an event's value: what the number in its row means
STATISTICS = {"started": "ranks", "finished": "steps", "crashed": "step", "rank_lost": "ranks",
              "hang": "seconds", "slow_rank": "seconds", "throughput_drop": "ratio"}
# events that say something went wrong are also written to anomaly.json; a start and an end are not anomalies
DUMPED = ("crashed", "rank_lost", "hang", "slow_rank", "throughput_drop")
VERSIONED = (("mindmon", "mindmon"), ("mindspore", "MindSpore"), ("mindformers", "MindFormers"))
assert set(TITLES) == set(EVENT_KINDS)


def now_text() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="milliseconds")


def versions() -> Dict[str, str]:
    """Installed versions read from package metadata: nothing is imported (MindSpore's import takes seconds)."""
    from importlib import metadata

    found = {"Python": sys.version.split()[0]}
    for package, label in VERSIONED:
        try:
            found[label] = metadata.version(package)
        except metadata.PackageNotFoundError:
            continue
    return found


def started_details(monitored: Sequence[str] = (), layout: Optional[str] = None,
                    hosts: Optional[Sequence[str]] = None, world_size: Optional[int] = None,
                    max_steps: Optional[int] = None, output_dir: Optional[str] = None) -> Dict[str, Any]:
    """What a `started` event tells: what is monitored, the parallel layout, the hosts (this one when
    not given), the versions, the process."""
    details: Dict[str, Any] = {"monitored": list(monitored)}
    if layout:
        details["layout"] = layout
    details["hosts"] = list(hosts) if hosts else [socket.gethostname()]
    if world_size is not None:
        details["world_size"] = int(world_size)
    if max_steps is not None:
        details["max_steps"] = int(max_steps)
    if output_dir is not None:
        details["output_dir"] = str(output_dir)
    details["versions"] = versions()
    details["pid"] = os.getpid()
    return details


def exception_line(error: BaseException) -> str:
    """The last line Python prints for an exception (`ValueError: loss is nan`), on one line."""
    lines = traceback.format_exception_only(type(error), error)
    return " ".join(lines[-1].split()) if lines else type(error).__name__


def hang_details(hang: Any) -> Dict[str, Any]:
    """The peer watchdog's `Hang` (mindmon.parallel.watchdog), as JSON values."""
    step, phase = hang.majority
    return {"number": int(hang.number), "stalled_seconds": round(float(hang.stalled), 3),
            "hang_after_seconds": round(float(hang.hang_after), 3), "odd_ranks": [int(r) for r in hang.odd],
            "majority": {"step": int(step), "phase": str(phase)}, "stacks": str(hang.stacks)}


def _phrase(values: Sequence[Any]) -> str:
    return ", ".join(str(v) for v in values)


def _started(rank: int, step: int, details: Dict[str, Any]) -> str:
    parts = [f"monitoring {_phrase(details['monitored'])}" if details.get("monitored") else "monitoring"]
    if details.get("layout"):
        parts.append(f"layout {details['layout']}")
    if details.get("world_size"):
        parts.append(f"{details['world_size']} ranks")
    parts.append(f"hosts {_phrase(details.get('hosts', []))}")
    if details.get("versions"):
        parts.append(_phrase(f"{name} {version}" for name, version in details["versions"].items()))
    where = f" at step {step}" if step else ""
    return f"run started on rank {rank}{where}: " + "; ".join(parts)


def event_message(kind: str, rank: int, step: int, details: Dict[str, Any]) -> str:
    """One line for an event no observer worded."""
    if kind == "started":
        return _started(rank, step, details)
    if kind == "finished":
        how = f" ({details['reason']})" if details.get("reason") else ""
        return f"run finished on rank {rank} after step {step}{how}"
    if kind == "crashed":
        return f"run crashed on rank {rank} at step {step}: {details.get('exception', 'an exception')}"
    if kind == "rank_lost":
        return f"{_ranks(details.get('lost_ranks', []))} lost at step {step} (seen by rank {rank})"
    if kind == "hang":
        return f"hang at step {step}: no rank has progressed for {details.get('stalled_seconds', '?')} s"
    return (f"rank {rank} is slow at step {step}: {details.get('seconds', '?')} s against a median of "
            f"{details.get('median_seconds', '?')} s")


def _ranks(ranks: Sequence[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {list(ranks)}"


def detail_lines(details: Dict[str, Any], indent: str = "    ") -> List[str]:
    """`key: value` lines of an event's details, for the e-mail and chat texts."""
    lines = []
    for key, value in details.items():
        if isinstance(value, dict):
            value = ", ".join(f"{k} {v}" for k, v in value.items())
        elif isinstance(value, (list, tuple)):
            value = _phrase(value)
        lines.append(f"{indent}{key}: {value}")
    return lines
