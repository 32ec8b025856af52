"""The alert path as a MindFormers user runs it: `mindmon demo --config` with a `monitor.alert` rule
tuned to fire delivers every anomaly to a real PostgreSQL server and by e-mail to a real SMTP server,
and `mindmon anomalies` orders them. Which steps fire is checked against the rule's definition
applied here, in numpy, to the run's own JSONL values."""
import json
import subprocess
import sys

import numpy as np
import yaml

from tests.support.jsonl import read_jsonl
from tests.features.alerts.test_alerts import email_inform

THRESHOLD = 0.005
STEPS = 5


def _expected(rows, kind):
    """Steps where AnomalyTurbulence fires on `kind`: |v - mean(|earlier values|)| > THRESHOLD x that mean."""
    values = [r["value"] for r in sorted((r for r in rows if r["kind"] == kind), key=lambda r: r["step"])]
    fired = []
    for index in range(1, len(values)):
        history = np.abs(values[:index]).mean()
        if abs(abs(values[index]) - history) > THRESHOLD * history:
            fired.append(index + 1)
    return fired


def test_demo_delivers_anomalies_to_postgresql_and_email(tmp_path, postgres_url, smtp_inbox):  # noqa: F811
    from sqlalchemy import create_engine, text

    url = postgres_url.render_as_string(hide_password=False)
    alert = {"rules": [{"rule_name": "AnomalyTurbulence", "args": {"threshold": THRESHOLD},
                        "kinds": ["device_loss", "grad_norm"], "statistics": ["loss", "norm"]}],
             "dump": True,
             "inform": [{"recipient": "database", "connection_str": url, "table": "demo_anomalies"},
                        email_inform(smtp_inbox.host, smtp_inbox.port)]}
    overlay = tmp_path / "alerts.yaml"
    overlay.write_text(yaml.safe_dump({"monitor": {"train_state": {"device_loss": True}, "alert": alert}}))
    out = tmp_path / "out"
    result = subprocess.run([sys.executable, "-m", "mindmon", "demo", "--steps", str(STEPS), "--output", str(out),
                             "--config", str(overlay)], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert postgres_url.password not in result.stdout + result.stderr   # never in a log line

    rows = read_jsonl(out / "monitor" / "rank_0" / "metrics.jsonl")
    expected = {("device_loss", s) for s in _expected(rows, "device_loss")} | \
               {("grad_norm", s) for s in _expected(rows, "grad_norm")}
    assert expected, "the rule is tuned to fire on this run"
    with create_engine(postgres_url).connect() as connection:
        stored = connection.execute(text("SELECT kind, step, rule_name FROM demo_anomalies")).fetchall()
        shown = connection.execute(text("SELECT id, step, tag_name, statistic, value_text, rule_name "
                                        "FROM demo_anomalies ORDER BY id")).fetchall()
    print("\n[alerts demo] rows in PostgreSQL:", *shown, sep="\n  ")
    assert {(kind, step) for kind, step, _ in stored} == expected and len(stored) == len(expected)
    assert {rule for _, _, rule in stored} == {"AnomalyTurbulence"}

    assert smtp_inbox.received.wait(30)
    body = "\n".join(m.get_payload(decode=True).decode() for m in smtp_inbox.messages)
    print(f"[alerts demo] e-mail received: {smtp_inbox.messages[0]['Subject']}\n{body[:600]}")
    assert all(f"step {step}" in body for _, step in expected)

    analysed = subprocess.run([sys.executable, "-m", "mindmon", "anomalies", "-d", str(out / "monitor"), "-k", "3"],
                              capture_output=True, text=True, timeout=120)
    assert analysed.returncode == 0, analysed.stderr
    top = json.loads((out / "monitor" / "anomaly_detected" / "anomaly_analyse.json").read_text())
    steps = [entry["step"] for entry in top.values()]
    assert steps == sorted(steps) and steps[0] == min(step for _, step in expected) and len(top) == 3
