"""The `alert` block (msprobe's config.json `alert`, mindmon's YAML `monitor.alert`): rules, dump,
inform (delivery) and the opt-in actions. Every error names the key path, the value and what is
allowed; passwords are never part of a message.

Example:
    config = AlertConfig.parse("monitor.alert", {
        "rules": [{"rule_name": "AnomalyNan", "args": {"threshold": 1e10}},
                  {"rule_name": "AnomalyTurbulence", "args": {"threshold": 0.5}}],
        "dump": True,
        "inform": {"recipient": "database", "connection_str": "sqlite:///alerts.db"}})
    rules = config.build_rules()
"""
import dataclasses
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

from mindmon.config import ConfigError, Section, check_keys, is_int, setting, type_error, value_error
from mindmon.config.fields import boolean, custom, keys_of, parse_settings
from mindmon.features.alerts.msprobe_rule import EmaTurbulence
from mindmon.features.alerts.rules import RULES, AnomalyTurbulence, Rule

SELECTION_KEYS = ("kinds", "statistics")
RULE_ARGS = {  # rule_name -> {arg: required?}
    "AnomalyTurbulence": {"threshold": True, "window": False, "direction": False, "average": False},
    "AnomalyNan": {"threshold": False},
    "LossSpike": {"threshold": False, "window": False, "min_history": False},
    "MoELoadImbalance": {"threshold": True},
    "SkippedSteps": {"threshold": True},
}
# Which config a block came from: msprobe's and kj600's config.json follow msprobe's rules (its
# AnomalyTurbulence, 0-based steps in the dump); mindmon's YAML follows mindmon's.
DIALECTS = ("mindmon", "msprobe")
# AnomalyTurbulence's history: "mean" of the earlier |x| (mindmon's), "ema" (msprobe's exponential average).
TURBULENCE_AVERAGES = {"mean": AnomalyTurbulence, "ema": EmaTurbulence}
DEFAULT_AVERAGE = {"mindmon": "mean", "msprobe": "ema"}


def _number(path: str, value: Any, minimum: float = 0.0) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise type_error(path, value, f"a number >= {minimum:g}")
    if not value >= minimum or value == float("inf"):
        raise value_error(path, value, f"a finite number >= {minimum:g}")
    return float(value)


def _positive_int(path: str, value: Any) -> int:
    if not is_int(value):
        raise type_error(path, value, "a positive int")
    if value < 1:
        raise value_error(path, value, "a positive int")
    return value


def _names(path: str, value: Any) -> Tuple[str, ...]:
    if not isinstance(value, list) or not value or not all(isinstance(v, str) and v for v in value):
        raise type_error(path, value, "a non-empty list of non-empty strings")
    return tuple(value)


def _rule_arg(path: str, rule_name: str, key: str, value: Any):
    if key == "threshold" and rule_name == "SkippedSteps":
        return _positive_int(path, value)   # a count of steps
    if key == "threshold":
        return _number(path, value, 1.0 if rule_name == "MoELoadImbalance" else 0.0)
    if key == "window":
        return None if value is None and rule_name == "AnomalyTurbulence" else _positive_int(path, value)
    if key == "min_history":
        return _positive_int(path, value)
    if key == "average":
        if value not in TURBULENCE_AVERAGES:
            raise value_error(path, value, f"one of {list(TURBULENCE_AVERAGES)}")
        return value
    if value not in ("both", "up"):
        raise value_error(path, value, '"both" or "up"')
    return value


def _turbulence_args(path: str, parsed: Dict[str, Any], dialect: str) -> Dict[str, Any]:
    """The average made explicit (the dialect's default), and `window` only where it means something."""
    parsed = dict(parsed)
    parsed.setdefault("average", DEFAULT_AVERAGE[dialect])
    if parsed["average"] == "ema" and parsed.get("window") is not None:
        raise value_error(f"{path}.args.window", parsed["window"],
                           'no window with average "ema" (the exponential average weighs every earlier value); '
                           'a window needs average "mean"')
    if parsed["average"] == "ema":
        parsed.pop("window", None)   # `window: null` says "no window", which is what ema means
    return parsed


@dataclass(frozen=True)
class RuleConfig:
    rule_name: str
    args: Dict[str, Any] = field(default_factory=dict)
    kinds: Optional[Tuple[str, ...]] = None
    statistics: Optional[Tuple[str, ...]] = None

    @classmethod
    def parse(cls, path: str, section: Any, dialect: Optional[str] = "mindmon") -> "RuleConfig":
        """One rule; with `dialect` None, AnomalyTurbulence's average is left for `in_dialect` to settle."""
        section = check_keys(path, section, ("rule_name", "args") + SELECTION_KEYS)
        name = section.get("rule_name")
        if name not in RULES:
            raise value_error(f"{path}.rule_name", name, f"one of {sorted(RULES)}")
        allowed = RULE_ARGS[name]
        args = check_keys(f"{path}.args", section.get("args"), tuple(allowed))
        for key, required in allowed.items():
            if required and key not in args:
                raise ConfigError(f"{path}.args.{key}: missing; {name} needs it (a number)")
        parsed = {key: _rule_arg(f"{path}.args.{key}", name, key, value) for key, value in args.items()}
        if name == "LossSpike" and parsed.get("min_history", 5) > parsed.get("window", 10):
            raise value_error(f"{path}.args.min_history", parsed.get("min_history", 5),
                               f"at most window ({parsed.get('window', 10)})")
        if name == "AnomalyTurbulence" and dialect is not None:
            parsed = _turbulence_args(path, parsed, dialect)
        selection = {key: _names(f"{path}.{key}", section[key]) for key in SELECTION_KEYS
                     if section.get(key) is not None}
        return cls(name, parsed, **selection)

    def in_dialect(self, path: str, dialect: str) -> "RuleConfig":
        """The rule with the dialect's defaults (AnomalyTurbulence's average) made explicit."""
        if self.rule_name != "AnomalyTurbulence":
            return self
        return dataclasses.replace(self, args=_turbulence_args(path, self.args, dialect))

    def build(self) -> Rule:
        args = dict(self.args)
        rule = TURBULENCE_AVERAGES[args.pop("average")] if self.rule_name == "AnomalyTurbulence" else \
            RULES[self.rule_name]
        return rule(kinds=self.kinds, statistics=self.statistics, **args)

    def to_dict(self) -> dict:
        out = {"rule_name": self.rule_name, "args": dict(self.args)}
        out.update({key: list(getattr(self, key)) for key in SELECTION_KEYS if getattr(self, key) is not None})
        return out


def _rules(path: str, value: Any) -> Tuple[RuleConfig, ...]:
    if not isinstance(value, list) or not value:
        raise type_error(path, value, 'a non-empty list of {"rule_name": ..., "args": {...}}')
    return tuple(RuleConfig.parse(f"{path}[{i}]", rule, dialect=None) for i, rule in enumerate(value))


def _inform(path: str, value: Any) -> tuple:
    from mindmon.features.alerts.inform import parse_inform

    return parse_inform(path, value)


def _inform_yaml(inform: tuple) -> Any:
    """One recipient as a mapping, several as a list, none as None; passwords shown as `***`."""
    items = [item.to_dict() for item in inform]
    return (items[0] if len(items) == 1 else items) or None


@dataclass(frozen=True)
class AlertConfig(Section):
    rules: Tuple[RuleConfig, ...] = setting((), custom("list of rules", _rules),
                                            shown_default="required (when the section is given)")
    """Evaluated in order for every value; the first that fires is reported."""

    dump: bool = setting(False, boolean())
    """Write `<output>/anomaly_detected/rank<r>/anomaly.json`."""

    inform: Tuple[Any, ...] = setting((), custom("mapping, list of mappings, or absent", _inform),
                                      shown_default="absent (no delivery)", dump=_inform_yaml)
    """Where anomalies and run events are delivered; kj600 takes one mapping, mindmon also a list (a
    database, an e-mail, webhooks)."""

    stop_on_anomaly: bool = setting(False, boolean())
    """mindmon: ask the training loop to stop after the step that produced an anomaly."""

    skip_nonfinite_update: bool = setting(False, boolean())
    """mindmon: ask the training loop to skip the optimizer update when the global gradient norm is not
    finite."""

    path: str = "monitor.alert"             # where it was read, for the errors found when it is built
    dialect: str = "mindmon"                # "msprobe": from msprobe's or kj600's config.json

    @property
    def active(self) -> bool:
        return bool(self.rules)

    @property
    def first_step(self) -> int:
        """The number of a run's first step in the dump: 0 as msprobe's files (and their CSV) count,
        1 as mindmon's records count."""
        return 0 if self.dialect == "msprobe" else 1

    @classmethod
    def parse(cls, path: str, raw: Any, dialect: str = "mindmon") -> Optional["AlertConfig"]:
        """None when absent; `{}` is the block with no rule (off)."""
        if raw is None:
            return None
        section = check_keys(path, raw, keys_of(cls))
        if not section:
            return cls(path=path, dialect=dialect)
        if "rules" not in section:
            raise ConfigError(f"{path}.rules: missing; allowed: a non-empty list of rules "
                              f"(rule_name one of {sorted(RULES)})")
        values = parse_settings(cls, path, section)
        values["rules"] = tuple(rule.in_dialect(f"{path}.rules[{i}]", dialect) for i, rule in enumerate(values["rules"]))
        return cls(**values, path=path, dialect=dialect)

    def build_rules(self) -> List[Rule]:
        return [rule.build() for rule in self.rules]
