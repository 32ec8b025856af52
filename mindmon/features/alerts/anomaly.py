"""One anomaly: what fired, on which value, and where it sits in the run (for ordering). A run event
(started, crashed, a hang, ...: mindmon.features.alerts.lifecycle) travels as an anomaly with
`details`, so it takes the same buffer, spool, retries and `mindmon alerts resend`."""
import json
import math
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

# msprobe's anomaly.json fields, in its order; mindmon adds the fields after them.
DUMP_FIELDS = ("rank", "step", "micro_step", "pp_stage", "vpp_stage", "call_id", "tag_name", "message",
               "group_mates")
EXTRA_FIELDS = ("kind", "name", "statistic", "value", "rule_name")


@dataclass(frozen=True)
class Anomaly:
    rank: int
    step: int
    micro_step: Optional[int]
    call_id: int             # order of the value among everything this rank's sink was given
    kind: str
    name: str
    tag_name: str            # `<kind>/<name>`; msprobe's dialect: `0:<name>/rank<r>/<point>` (no statistic)
    statistic: str
    value: float
    rule_name: str
    message: str
    pp_stage: int = 0
    vpp_stage: int = 0
    group_mates: List[int] = field(default_factory=list)
    details: Optional[Dict[str, Any]] = None   # a run event's facts (JSON values); None for an anomaly

    @property
    def is_event(self) -> bool:
        return self.details is not None

    @property
    def key(self) -> str:
        """Unique per (tag, statistic, step, micro-step): msprobe's `<tag>_step_<s>_call_<id>`
        with the statistic and micro-step added, so no anomaly overwrites another."""
        micro = "" if self.micro_step is None else f"_micro_{self.micro_step}"
        return f"{self.tag_name}/{self.statistic}_step_{self.step}{micro}_call_{self.call_id}"

    def to_json(self) -> dict:
        out = {name: getattr(self, name) for name in DUMP_FIELDS + EXTRA_FIELDS}
        out["group_mates"] = list(self.group_mates)
        out["value"] = self.value if math.isfinite(self.value) else str(self.value)  # strict JSON: no NaN
        if self.details is not None:
            out["details"] = self.details
        return out

    def row(self) -> dict:
        """A database row: the value as a float column (NULL when not finite) and as text."""
        out = self.to_json()
        out["value"] = self.value if math.isfinite(self.value) else None
        out["value_text"] = repr(self.value)
        out["group_mates"] = ",".join(str(r) for r in self.group_mates)
        out["details"] = None if self.details is None else json.dumps(self.details, sort_keys=True)
        return out


def anomaly_key(run_id: str, anomaly: Anomaly) -> str:
    """The idempotency key of one anomaly: a hash of run id, rank, step, micro-step, tag and
    statistic (64 hex digits, short enough for a unique index on every database). A run event's key
    also covers its details (which hold the instant it was reported): two hangs at one step are two
    events, one event spooled and sent again is one."""
    import hashlib

    parts = [run_id, anomaly.rank, anomaly.step, anomaly.micro_step, anomaly.tag_name, anomaly.statistic]
    if anomaly.details is not None:
        parts.append(json.dumps(anomaly.details, sort_keys=True))
    return hashlib.sha256(json.dumps(parts).encode()).hexdigest()


def anomaly_from_json(entry: dict) -> Anomaly:
    """The inverse of `Anomaly.to_json` (a spool line, a dump entry)."""
    fields = {name: entry[name] for name in DUMP_FIELDS + EXTRA_FIELDS if name in entry}
    fields["value"] = float(fields["value"])    # "nan", "inf", "-inf" back to floats
    fields["group_mates"] = list(fields.get("group_mates", []))
    return Anomaly(**fields, details=entry.get("details"))


@dataclass(frozen=True)
class KeyedAnomaly:
    """An anomaly on its way to a recipient, with the key that makes its delivery idempotent."""

    run_id: str
    key: str
    anomaly: Anomaly

    @classmethod
    def of(cls, run_id: str, anomaly: Anomaly) -> "KeyedAnomaly":
        return cls(run_id, anomaly_key(run_id, anomaly), anomaly)

    def to_line(self) -> str:
        return json.dumps({"run_id": self.run_id, "key": self.key, "anomaly": self.anomaly.to_json()},
                          allow_nan=False) + "\n"

    @classmethod
    def from_line(cls, line: str) -> "KeyedAnomaly":
        entry = json.loads(line)
        return cls(entry["run_id"], entry["key"], anomaly_from_json(entry["anomaly"]))
