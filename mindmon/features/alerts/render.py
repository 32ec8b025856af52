"""The text of one delivery (a batch of anomalies and run events) as a person reads it: the e-mail's
subject and body, a chat message's title and text. Under a storm it is a digest: the run events in
full, the anomalies counted by rule and tag, the first `listed` of them in full.

Example:
    title(items)          # 'mindmon: 3 anomalies on rank 0, step 4' / 'mindmon: run crashed on rank 0, step 12'
    body(items, 20)       # the digest, one line per entry
    fit(text, 4096)       # cut to a service's size limit in UTF-8 bytes, on a line boundary
"""
from collections import Counter
from typing import List, Sequence

from mindmon.features.alerts.anomaly import KeyedAnomaly
from mindmon.features.alerts.lifecycle import TITLES, detail_lines


def _count(n: int, one: str, many: str) -> str:
    return f"{n} {one if n == 1 else many}"


def _span(values: Sequence[int], one: str, many: str) -> str:
    values = sorted(set(values))
    if len(values) == 1:
        return f"{one} {values[0]}"
    return f"{many} {values[0]}-{values[-1]}"


def title(items: Sequence[KeyedAnomaly]) -> str:
    everything = [item.anomaly for item in items]
    events = [a for a in everything if a.is_event]
    anomalies = [a for a in everything if not a.is_event]
    ranks = ",".join(map(str, sorted({a.rank for a in everything})))
    where = f"on rank {ranks}, {_span([a.step for a in everything], 'step', 'steps')}"
    if len(events) == 1 and not anomalies:
        return f"mindmon: {TITLES.get(events[0].kind, events[0].kind)} {where}"
    parts = []
    if events:
        kinds = ", ".join(dict.fromkeys(TITLES.get(a.kind, a.kind) for a in events))
        parts.append(f"{_count(len(events), 'event', 'events')} ({kinds})")
    if anomalies:
        parts.append(_count(len(anomalies), "anomaly", "anomalies"))
    return f"mindmon: {' and '.join(parts)} {where}"


def event_lines(items: Sequence[KeyedAnomaly]) -> List[str]:
    events = [item.anomaly for item in items if item.anomaly.is_event]
    if not events:
        return []
    lines = ["Run events:"]
    for event in events:
        lines.append(f"- [{event.kind}] {event.message}")
        lines += detail_lines(event.details)
    return lines + [""]


def anomaly_lines(items: Sequence[KeyedAnomaly], listed: int) -> List[str]:
    """Counts by rule and tag, then the first `listed` anomalies in full."""
    anomalies = [item.anomaly for item in items if not item.anomaly.is_event]
    if not anomalies:
        return []
    counts = Counter((a.rule_name, a.tag_name, a.statistic) for a in anomalies)
    lines = [f"{_count(len(anomalies), 'anomaly', 'anomalies')} detected by mindmon.", "", "By rule and tag:"]
    lines += [f"  {count:>7}  {rule}  {tag} {statistic}" for (rule, tag, statistic), count in counts.most_common()]
    lines += ["", f"The first {min(listed, len(anomalies))} in full:"] if len(anomalies) > listed else [""]
    lines += [f"- {a.message}" for a in anomalies[:listed]]
    if len(anomalies) > listed:
        lines += ["", f"{len(anomalies) - listed} more are counted above and not listed (all are in the "
                      f"run's anomaly.json)."]
    return lines


def body(items: Sequence[KeyedAnomaly], listed: int) -> str:
    return "\n".join(event_lines(items) + anomaly_lines(items, listed)).rstrip("\n") + "\n"


def fit(text: str, limit: int) -> str:
    """`text` within `limit` UTF-8 bytes: whole lines kept from the top, and a last line saying how
    many were cut."""
    if len(text.encode()) <= limit:
        return text
    lines, kept, size = text.split("\n"), [], 0
    reserve = 120   # room for the closing line
    for line in lines:
        cost = len(line.encode()) + 1
        if size + cost > limit - reserve:
            break
        kept.append(line)
        size += cost
    if not kept:   # one line longer than the limit: cut inside it, on a character boundary
        kept = [text.encode()[:limit - reserve].decode(errors="ignore")]
    kept.append(f"[{len(lines) - len(kept)} more lines cut to fit the service's message size; all are in "
                f"anomaly.json and the log]")
    return "\n".join(kept)
