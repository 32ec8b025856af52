"""Public face of the alerts (mindmon/features/alerts/): `from mindmon.alerts import AlertConfig, AlertSink`."""
from mindmon.features.alerts import (RULES, AlertActions, AlertConfig, AlertSink, Anomaly, AnomalyNan, AnomalyTurbulence,
                                     DeliveryReport, LossSpike, MoELoadImbalance, Rule, RuleConfig, build_alert_sink,
                                     delivery_note, scalar_value, tag_and_statistic)

__all__ = ["AlertActions", "AlertConfig", "AlertSink", "Anomaly", "AnomalyNan", "AnomalyTurbulence", "DeliveryReport",
           "LossSpike", "MoELoadImbalance", "RULES", "Rule", "RuleConfig", "build_alert_sink", "delivery_note",
           "scalar_value", "tag_and_statistic"]
