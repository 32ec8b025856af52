"""Anomaly alerts: rules over mindmon records, msprobe's anomaly.json dump, the analysis of dumps,
delivery to a database, by e-mail or to a webhook, and run events to the same recipients. See
docs/alerts.md.

Example:
    from mindmon.features.alerts import AlertConfig, AlertSink
    sink = AlertSink(AlertConfig.parse("monitor.alert", {"rules": [
        {"rule_name": "AnomalyNan"}, {"rule_name": "AnomalyTurbulence", "args": {"threshold": 0.5}}],
        "dump": True}), output_dir="./output/monitor")
"""
from mindmon.features.alerts.actions import AlertActions
from mindmon.features.alerts.anomaly import Anomaly
from mindmon.features.alerts.config import AlertConfig, RuleConfig
from mindmon.features.alerts.delivery import DeliveryReport
from mindmon.features.alerts.rules import (RULES, AnomalyNan, AnomalyTurbulence, LossSpike, MoELoadImbalance, Rule,
                    scalar_value, tag_and_statistic)
from mindmon.features.alerts.sink import AlertSink, build_alert_sink, delivery_note
from mindmon.core.engine import Feature

__all__ = ["AlertActions", "AlertConfig", "AlertSink", "Anomaly", "AnomalyNan", "AnomalyTurbulence",
           "DeliveryReport", "LossSpike", "build_alert_sink", "delivery_note", "MoELoadImbalance", "RULES", "Rule", "RuleConfig",
           "scalar_value", "tag_and_statistic", "FEATURE"]


def build(build, section: AlertConfig) -> None:
    """The alert sink (on every rank: each judges its own records) and its actions."""
    if not section.active:
        return
    pipeline = build.layout.groups.get("pp") if build.layout is not None else None
    sink, actions = build_alert_sink(section, build.config.monitor.output_dir, build.rank, build.logger,
                                     build.data_parallel, path=section.path, pipeline=pipeline,
                                     monitored=_monitored(build.config))
    build.sinks.append(sink)
    build.parts["alert"] = sink   # the front doors and the watchdog report run events to it (AlertSink.report_event)
    build.add_actions(actions)


def _monitored(config) -> list:
    """The names of the capabilities the run's configuration switches on (the `started` event says them)."""
    from mindmon.features import FEATURES, section_of

    sections = [(feature.name, section_of(config, feature)) for feature in FEATURES]
    return [name for name, section in sections if section is not None and getattr(section, "active", False)]


FEATURE = Feature("alert", "monitor.alert", parse=AlertConfig.parse, build=build,
                  example={"monitor": {"alert": {"rules": [{"rule_name": "AnomalyNan"}], "dump": True}}})
