"""Anomaly alerts: rules over mindmon records, msprobe's anomaly.json dump, the analysis of dumps,
and delivery to a database or by e-mail. See docs/alerts.md.

Example:
    from mindmon.alerts import AlertConfig, AlertSink
    sink = AlertSink(AlertConfig.parse("monitor.alert", {"rules": [
        {"rule_name": "AnomalyNan"}, {"rule_name": "AnomalyTurbulence", "args": {"threshold": 0.5}}],
        "dump": True}), output_dir="./output/monitor")
"""
from .actions import AlertActions
from .anomaly import Anomaly
from .config import AlertConfig, RuleConfig
from .delivery import DeliveryReport
from .rules import (RULES, AnomalyNan, AnomalyTurbulence, LossSpike, MoELoadImbalance, Rule,
                    scalar_value, tag_and_statistic)
from .sink import AlertSink, build_alert_sink, delivery_note

__all__ = ["AlertActions", "AlertConfig", "AlertSink", "Anomaly", "AnomalyNan", "AnomalyTurbulence",
           "DeliveryReport", "LossSpike", "build_alert_sink", "delivery_note", "MoELoadImbalance", "RULES", "Rule", "RuleConfig",
           "scalar_value", "tag_and_statistic"]
