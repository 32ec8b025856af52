"""An alert storm: a rule firing on 10^4 values a step (msprobe's six statistics of 1,700 parameter tensors)
for a few steps, delivered to a real PostgreSQL (batched inserts) and a real SMTP server (one
digest per interval: counts by rule and tag, the first anomalies in full). The step's cost in the
sink is printed, never asserted."""
import logging
import statistics
import time
from collections import Counter

import pytest

from mindmon.features.alerts import AlertConfig, AlertSink
from mindmon.core.records import Record
from tests.features.alerts.test_alerts_outages import email_counts, select_rows, url_text
from tests.features.alerts.test_alerts import email_inform

pytestmark = pytest.mark.serial   # deliveries paced and retried in real time

PARAMETERS, STATISTICS, STEPS = 1700, ("norm", "min", "max", "mean", "zeros", "nans"), 5
EVERY_VALUE = {"rule_name": "AnomalyNan", "args": {"threshold": 0.0},
               "kinds": ["grad_reduced"], "statistics": list(STATISTICS)}


def storm_records(step):
    return [Record(step, None, 0, "grad_reduced", f"layers.{p}.weight/{statistic}", 1.0 + p + s / 10)
            for p in range(PARAMETERS) for s, statistic in enumerate(STATISTICS)]


def test_a_storm_is_batched_and_rate_limited(tmp_path, postgres_server, smtp_inbox, caplog):
    config = AlertConfig.parse("monitor.alert", {"rules": [EVERY_VALUE], "dump": True, "inform": [
        {"connection_str": url_text(postgres_server.url), "table": "storm_rows", "batch_size": 1000},
        email_inform(smtp_inbox.host, smtp_inbox.port, email_interval=2, email_listed=20)]})
    sink = AlertSink(config, str(tmp_path))
    costs = []
    with caplog.at_level(logging.INFO, logger="mindmon"):
        for step in range(1, STEPS + 1):
            records = storm_records(step)
            started = time.perf_counter()
            sink.write(records)
            sink.flush()
            costs.append(time.perf_counter() - started)
            time.sleep(0.5)
        sink.close()
    total = PARAMETERS * len(STATISTICS) * STEPS
    print(f"\n[storm] {total // STEPS} anomalies a step; the sink's write + flush (rules, log, dump, hand-off; "
          f"machine shared): median {statistics.median(costs) * 1e3:.0f} ms, per step "
          + ", ".join(f"{c * 1e3:.0f}" for c in costs) + " ms")
    print("[storm] " + "; ".join(report.summary() for report in sink.reports))
    rows = select_rows(postgres_server.url, "storm_rows")
    assert len(rows) == total == len({row[4] for row in rows})
    assert Counter(row[0] for row in rows) == {step: total // STEPS for step in range(1, STEPS + 1)}
    per_message, by_tag = email_counts(smtp_inbox.messages)
    print(f"[storm] e-mails: {len(per_message)}, anomalies in each: {per_message}")
    gaps = [later - earlier for earlier, later in zip(smtp_inbox.arrival_times, smtp_inbox.arrival_times[1:])]
    print(f"[storm] seconds between e-mails: {[round(g, 2) for g in gaps]}")
    assert sum(per_message) == total and len(per_message) >= 2
    assert all(gap >= 2.0 - 0.05 for gap in gaps[:-1])   # one digest per interval; the last one sent at close
    assert set(by_tag.values()) == {STEPS} and len(by_tag) == total // STEPS
    body = smtp_inbox.messages[0].get_payload(decode=True).decode()
    assert body.count("\n- Rule AnomalyNan") == 20 and "more are counted above and not listed" in body
    assert sink.reports[1].folded == total - 20 * len(per_message)
    assert "folded into counts by rule and tag" in caplog.text
    assert caplog.text.count("more anomalies at step") == STEPS   # the log lists 20 a step and counts the rest
