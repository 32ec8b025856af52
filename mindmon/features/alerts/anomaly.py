"""One anomaly: what fired, on which value, and where it sits in the run (for ordering)."""
import math
from dataclasses import dataclass, field
from typing import List, Optional

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
    tag_name: str            # `<kind>/<name>` (msprobe statistics: without the statistic)
    statistic: str
    value: float
    rule_name: str
    message: str
    pp_stage: int = 0
    vpp_stage: int = 0
    group_mates: List[int] = field(default_factory=list)

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
        return out

    def row(self) -> dict:
        """A database row: the value as a float column (NULL when not finite) and as text."""
        out = self.to_json()
        out["value"] = self.value if math.isfinite(self.value) else None
        out["value_text"] = repr(self.value)
        out["group_mates"] = ",".join(str(r) for r in self.group_mates)
        return out
