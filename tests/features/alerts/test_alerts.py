"""Alerts: rules against hand-computed values, the dump, the analysis, delivery to real servers
(PostgreSQL, SQLite, an SMTP server with STARTTLS and AUTH, one that hangs), and a plain MindSpore
loop end to end."""
import json
import logging
import math
import os
import subprocess
import sys

import numpy as np
import pytest

from mindmon.features.alerts import AlertActions, AlertConfig, AlertSink, build_alert_sink, delivery_note
from mindmon.features.alerts.anomaly import DUMP_FIELDS
from mindmon.config import ConfigError
from mindmon.parallel.data_parallel import DataParallel
from mindmon.core.engine import RunInfo
from mindmon.core.records import Record
from tests.support.servers import PG_PASSWORD, SMTP_PASSWORD, SMTP_USER, free_port
from tests.loop.test_plain_loop import Regression, _data as regression_data  # the tiny real MindSpore model

NAN = {"rule_name": "AnomalyNan"}


def make_sink(tmp_path, section, **kwargs):
    return AlertSink(AlertConfig.parse("monitor.alert", section), str(tmp_path), **kwargs)


def fired_steps(rules, values, kind="device_norm", name="w"):
    """Writes one value per step (1-based) and returns the steps that fired, with the rule."""
    sink = make_sink("/nonexistent", {"rules": rules})
    for step, value in enumerate(values, start=1):
        sink.write([Record(step, None, 0, kind, name, value)])
    return [(a.step, a.rule_name) for a in sink.recent]


def turbulence_reference(values, threshold, window=None, up=False):
    """The documented definition, in numpy float64: |x| against the mean of earlier finite |x|."""
    out, history = [], []
    for step, x in enumerate(np.abs(np.array(values, np.float64)), start=1):
        earlier = history if window is None else history[-window:]
        if earlier and np.isfinite(x):
            mean = np.mean(earlier)
            if (x > (1 + threshold) * mean) if up else (abs(x - mean) > threshold * mean):
                out.append(step)
        if np.isfinite(x):
            history.append(x)
    return out


@pytest.mark.parametrize("values,args,expected", [
    ([2.0, 4.0, 3.0, 10.0, -1.0, 4.5], {"threshold": 0.5}, [2, 4, 5]),
    ([1, 1, 1, 1, 3, 3, 3], {"threshold": 0.4}, [5, 6, 7]),
    ([1, 1, 1, 1, 3, 3, 3], {"threshold": 0.4, "window": 2}, [5, 6]),
    ([4, 1, 4], {"threshold": 0.5}, [2, 3]),
    ([4, 1, 4], {"threshold": 0.5, "direction": "up"}, [3]),
    ([1.0, float("nan"), 1.0, 1.2], {"threshold": 0.5}, []),   # NaN enters no history
])
def test_turbulence_matches_its_definition(values, args, expected):
    got = fired_steps([{"rule_name": "AnomalyTurbulence", "args": args}], values)
    assert [s for s, _ in got] == expected
    assert expected == turbulence_reference(values, args["threshold"], args.get("window"),
                                             args.get("direction") == "up")


@pytest.mark.parametrize("args,expected", [({}, [2, 3, 4]), ({"threshold": 1e10}, [2, 3, 4, 6])])
def test_nan_rule(args, expected):
    values = [1.0, float("nan"), float("inf"), float("-inf"), 5.0, -2e10]
    assert [s for s, _ in fired_steps([{"rule_name": "AnomalyNan", "args": args}], values)] == expected


def test_first_matching_rule_wins():
    nan_first = [{"rule_name": "AnomalyNan", "args": {"threshold": 10}},
                 {"rule_name": "AnomalyTurbulence", "args": {"threshold": 0.5}}]
    assert fired_steps(nan_first, [1, 1, 20]) == [(3, "AnomalyNan")]
    assert fired_steps(nan_first[::-1], [1, 1, 20]) == [(3, "AnomalyTurbulence")]


def test_loss_spike_is_a_ratio_to_the_running_median():
    losses = [1.0, 0.9, 0.8, 2.0, 0.7, 5.0, 1.5]
    rule = {"rule_name": "LossSpike", "args": {"threshold": 2.0, "window": 4, "min_history": 3}}
    expected = [s for s in range(4, len(losses) + 1)
                if losses[s - 1] > 2.0 * np.median(losses[max(0, s - 5):s - 1])]
    assert expected == [4, 6]
    assert [s for s, _ in fired_steps([rule], losses, kind="loss", name="loss")] == expected
    assert fired_steps([rule], losses, kind="local_loss", name="loss") == []  # not read by default


def test_moe_load_rule_and_list_values():
    assert fired_steps([{"rule_name": "MoELoadImbalance", "args": {"threshold": 1.5}}], [1.2, 1.6, 1.5],
                       kind="moe_max_over_mean", name="decoder.layers.1") == [(2, "MoELoadImbalance")]
    # per-head lists are judged by their largest element
    sink = make_sink("/nonexistent", {"rules": [{"rule_name": "AnomalyNan", "args": {"threshold": 40}}]})
    sink.write([Record(1, None, 0, "max_attention_logit", "decoder.layers.0", [3.0, 50.0]),
                Record(1, None, 0, "max_attention_logit", "decoder.layers.1", [39.0, 2.0]),
                Record(2, None, 0, "max_attention_logit", "decoder.layers.1", [float("nan"), 2.0])])
    assert [(a.step, a.name, a.statistic) for a in sink.recent] == [
        (1, "decoder.layers.0", "max"), (2, "decoder.layers.1", "max")]
    assert sink.recent[0].value == 50.0 and math.isnan(sink.recent[1].value)


def test_which_statistics_a_rule_reads():
    jump = [1.0, 1.0, 10.0]
    records = lambda step, v: [Record(step, None, 0, "device_norm", "w", v), Record(step, 0, 0, "local_norm", "w", v),
                               Record(step, None, 0, "device_loss", "loss", v),
                               Record(step, None, 0, "grad_reduced", "fc.weight/mean", v),
                               Record(step, None, 0, "grad_reduced", "fc.weight/min", v)]
    for statistics, expected in [(None, {("device_norm/w", "norm"), ("grad_reduced/fc.weight", "mean")}),
                                 (["loss", "min"], {("device_loss/loss", "loss"), ("grad_reduced/fc.weight", "min")})]:
        rule = {"rule_name": "AnomalyTurbulence", "args": {"threshold": 1.0}}
        if statistics:
            rule["statistics"] = statistics
        sink = make_sink("/nonexistent", {"rules": [rule]})
        for step, v in enumerate(jump, start=1):
            sink.write(records(step, v))
        assert {(a.tag_name, a.statistic) for a in sink.recent} == expected
    sink = make_sink("/nonexistent", {"rules": [{"rule_name": "AnomalyTurbulence", "args": {"threshold": 1.0},
                                                 "kinds": ["local_norm"], "statistics": ["norm_increment"]}]})
    for step, v in enumerate(jump, start=1):
        sink.write(records(step, v))
    assert [(a.kind, a.micro_step) for a in sink.recent] == [("local_norm", 0)]


def _read(path):
    with open(path) as f:
        return json.load(f)


def test_dump_keeps_every_statistic_and_micro_step(tmp_path):
    """msprobe loses one of `mean` and `norm` firing for one tag and step; mindmon keeps both."""
    sink = make_sink(tmp_path, {"rules": [NAN, {"rule_name": "AnomalyTurbulence", "args": {"threshold": 1.0}}],
                                "dump": True}, rank=3, group_mates=[2, 3])
    sink.open(RunInfo(rank=3))
    for step, (v, loss) in enumerate([(1.0, 0.5), (1.0, 0.5), (5.0, float("nan"))], start=1):
        sink.write([Record(step, None, 3, "grad_reduced", "fc1.weight/mean", v),
                    Record(step, None, 3, "grad_reduced", "fc1.weight/norm", v),
                    Record(step, 0, 3, "local_loss", "loss", loss), Record(step, 1, 3, "local_loss", "loss", loss)])
        sink.flush()
    sink.close()
    path = tmp_path / "anomaly_detected" / "rank3" / "anomaly.json"
    entries = _read(path)
    assert sorted((e["tag_name"], e["statistic"], e["step"], e["micro_step"]) for e in entries.values()) == [
        ("grad_reduced/fc1.weight", "mean", 3, None), ("grad_reduced/fc1.weight", "norm", 3, None),
        ("local_loss/loss", "loss", 3, 0), ("local_loss/loss", "loss", 3, 1)]
    first = next(iter(entries.values()))
    assert tuple(first)[:len(DUMP_FIELDS)] == DUMP_FIELDS  # msprobe's fields, in its order
    assert first["rank"] == 3 and first["group_mates"] == [2, 3] and first["value"] == 5.0
    assert [e["value"] for e in entries.values() if e["kind"] == "local_loss"] == ["nan", "nan"]
    assert os.listdir(path.parent) == ["anomaly.json"]  # no temporary file left
    resumed = make_sink(tmp_path, {"rules": [NAN], "dump": True})
    resumed.open(RunInfo(rank=3, start_step=3))
    resumed.write([Record(4, None, 3, "device_loss", "loss", float("inf"))])
    resumed.close()
    assert len(_read(path)) == 5


BAD_SECTIONS = [
    ({"rules": []}, "monitor.alert.rules"),
    ({"dump": True}, "monitor.alert.rules"),
    ({"rules": [{"rule_name": "AnomalyTurbulence"}]}, "monitor.alert.rules[0].args.threshold"),
    ({"rules": [{"rule_name": "AnomalyTurbulence", "args": {"threshold": "0.5"}}]},
     "monitor.alert.rules[0].args.threshold"),
    ({"rules": [NAN, {"rule_name": "AnomalyNan", "args": {"threshold": -1}}]},
     "monitor.alert.rules[1].args.threshold"),
    ({"rules": [{"rule_name": "Anomaly"}]}, "monitor.alert.rules[0].rule_name"),
    ({"rules": [{"rule_name": "AnomalyNan", "args": {"window": 3}}]}, "monitor.alert.rules[0].args.window"),
    ({"rules": [NAN, {"rule_name": "AnomalyNan", "statistics": []}]}, "monitor.alert.rules[1].statistics"),
    ({"rules": [{"rule_name": "LossSpike", "args": {"window": 3, "min_history": 4}}]},
     "monitor.alert.rules[0].args.min_history"),
    ({"rules": [{"rule_name": "AnomalyTurbulence", "args": {"threshold": 1, "direction": "down"}}]},
     "monitor.alert.rules[0].args.direction"),
    ({"rules": [NAN], "dump": "yes"}, "monitor.alert.dump"),
    ({"rules": [NAN], "dumps": True}, "monitor.alert.dumps"),
    ({"rules": [NAN], "inform": {"recipient": "pager"}}, "monitor.alert.inform.recipient"),
    ({"rules": [NAN], "inform": {"recipient": "database"}}, "monitor.alert.inform.connection_str"),
    ({"rules": [NAN], "inform": [{"connection_str": "sqlite://"}, {"recipient": "email", "smtp_server": "h",
                                                                   "send_email_address": "a@b"}]},
     "monitor.alert.inform[1].receive_email_address"),
    ({"rules": [NAN], "inform": {"recipient": "email", "smtp_server": "h", "send_email_address": "a@b",
                                 "receive_email_address": "c@d", "smtp_port": "five"}}, "monitor.alert.inform.smtp_port"),
    ({"rules": [NAN], "inform": {"connection_str": "sqlite://", "queue_size": 0}}, "monitor.alert.inform.queue_size"),
]


@pytest.mark.parametrize("section,key", BAD_SECTIONS)
def test_bad_sections_name_the_key(section, key):
    with pytest.raises(ConfigError) as error:
        AlertConfig.parse("monitor.alert", section)
    assert str(error.value).startswith(key + ":") or str(error.value).startswith(key + " ")
    assert "\n" not in str(error.value)


def test_passwords_never_appear_in_config_errors_or_dumps():
    sections = [{"connection_str": "postgresql://bob:hunter2@db:notaport/x"},
                {"recipient": "email", "smtp_server": "h", "send_email_address": "a@b", "receive_email_address": "c@d",
                 "send_email_password": ["hunter2"]}]
    for inform in sections:
        with pytest.raises(ConfigError) as error:
            AlertConfig.parse("alert", {"rules": [NAN], "inform": inform})
        assert str(error.value).startswith("alert.inform.") and "hunter2" not in str(error.value)
    config = AlertConfig.parse("alert", {"rules": [NAN], "inform": [
        {"connection_str": "mysql+pymysql://bob:hunter2@db:3306/x"},
        {"recipient": "email", "smtp_server": "h", "send_email_address": "a@b", "receive_email_address": "c@d",
         "send_email_username": "bob", "send_email_password": "hunter2", "smtp_port": "587"}]})
    assert "hunter2" not in json.dumps(config.to_dict()) + repr(config)
    assert config.to_dict()["inform"][0]["connection_str"] == "mysql+pymysql://bob:***@db:3306/x"
    assert config.inform[1].smtp_port == 587


def _entry(rank, step, micro, call, kind, pp=0):
    return {"rank": rank, "step": step, "micro_step": micro, "pp_stage": pp, "vpp_stage": 0, "call_id": call,
            "tag_name": f"{kind}/x", "message": f"{kind} r{rank} s{step}", "group_mates": [0, 1], "kind": kind}


def test_analysis_orders_first_in_time_across_ranks(tmp_path):
    dumps = {0: {"a": _entry(0, 3, None, 1, "device_norm"), "b": _entry(0, 2, 1, 9, "local_loss"),
                 "c": _entry(0, 2, None, 12, "device_loss")},
             1: {"d": _entry(1, 2, 1, 4, "local_norm"), "e": _entry(1, 2, 0, 8, "local_norm"),
                 "f": _entry(1, 5, 0, 2, "local_loss")}}
    for rank, entries in dumps.items():
        (tmp_path / "anomaly_detected" / f"rank{rank}").mkdir(parents=True)
        (tmp_path / "anomaly_detected" / f"rank{rank}" / "anomaly.json").write_text(json.dumps(entries))
    # step 2: micro 0 (e) < micro 1 forward (b) < micro 1 gradients (d) < step-level (c); then step 3 (a), step 5 (f)
    run = subprocess.run([sys.executable, "-m", "mindmon.msprobe.anomaly_processor", "-d", str(tmp_path), "-k", "5"],
                         capture_output=True, text=True, env={**os.environ, "PYTHONPATH": os.getcwd()})
    assert run.returncode == 0, run.stderr
    assert list(_read(tmp_path / "anomaly_detected" / "anomaly_analyse.json")) == ["e", "b", "d", "c", "a"]
    from argparse import ArgumentParser

    from mindmon.features.alerts import analyse

    parser = ArgumentParser()
    analyse.add_arguments(parser)
    out = tmp_path / "top.json"
    assert analyse.run(parser.parse_args(["-d", str(tmp_path / "anomaly_detected"), "-o", str(out),
                                          "-s", "[3, 5]"])) == 0
    assert list(_read(out)) == ["a", "f"]
    assert analyse.run(parser.parse_args(["-d", str(tmp_path / "missing")])) == 1


def _anomalous_steps(sink, steps=3):
    """Step 1 normal, then a NaN device loss and a doubled norm at every later step."""
    for step in range(1, steps + 1):
        sink.write([Record(step, None, 0, "device_norm", "fc.weight", 1.0 if step == 1 else 3.0 * step),
                    Record(step, None, 0, "device_loss", "loss", 0.5 if step == 1 else float("nan"))])
        sink.flush()


def _select_rows(url, table="mindmon_anomalies"):
    from sqlalchemy import create_engine, text

    engine = create_engine(url)
    with engine.connect() as connection:
        rows = connection.execute(text(f"SELECT step, tag_name, statistic, value, value_text, rule_name, message "
                                       f"FROM {table} ORDER BY id")).all()
    engine.dispose()
    return rows


DB_RULES = [NAN, {"rule_name": "AnomalyTurbulence", "args": {"threshold": 0.5}}]
EXPECTED_ROWS = [(2, "device_norm/fc.weight", "norm", 6.0, "AnomalyTurbulence"),
                 (2, "device_loss/loss", "loss", None, "AnomalyNan"),
                 (3, "device_norm/fc.weight", "norm", 9.0, "AnomalyTurbulence"),
                 (3, "device_loss/loss", "loss", None, "AnomalyNan")]


def test_sqlite_rows(tmp_path):
    url = f"sqlite:///{tmp_path / 'alerts.db'}"
    sink = make_sink(tmp_path, {"rules": DB_RULES, "inform": {"recipient": "database", "connection_str": url}})
    _anomalous_steps(sink)
    sink.close()
    assert sink.reports[0].delivered == 4 and sink.reports[0].complete
    assert [(r.step, r.tag_name, r.statistic, r.value, r.rule_name) for r in _select_rows(url)] == EXPECTED_ROWS


def test_postgresql_rows_and_no_password_anywhere(tmp_path, postgres_url, caplog):
    connection_str = postgres_url.render_as_string(hide_password=False)
    assert PG_PASSWORD not in connection_str  # %-escaped in the URL; masking must catch both forms
    with caplog.at_level(logging.INFO, logger="mindmon"):
        sink = make_sink(tmp_path, {"rules": DB_RULES, "dump": True, "inform": {
            "recipient": "database", "connection_str": connection_str, "table": "run_alerts"}})
        _anomalous_steps(sink)
        sink.close()
        wrong = make_sink(tmp_path, {"rules": [NAN], "inform": {
            "connection_str": connection_str.replace("s3cr", "wrong"), "close_timeout": 3, "retry_interval": 0.5}})
        _anomalous_steps(wrong, 2)
        wrong.close()
    rows = _select_rows(postgres_url, "run_alerts")
    assert [(r.step, r.tag_name, r.statistic, r.value, r.rule_name) for r in rows] == EXPECTED_ROWS
    assert rows[1].value_text == "nan" and rows[0].message.startswith("Rule AnomalyTurbulence reports")
    assert wrong.reports[0].undelivered == {"authentication failed": 1} and wrong.reports[0].failed_attempts >= 2
    assert "password authentication failed" in wrong.reports[0].errors[0]
    assert "(table run_alerts): 4 delivered, 0 failed attempts" in caplog.text
    dump = (tmp_path / "anomaly_detected" / "rank0" / "anomaly.json").read_text()
    for secret in (PG_PASSWORD, "pg-s3cr%40t", "pg-wrong", "s3cr@t"):
        assert secret not in caplog.text + dump + repr(sink.config) + json.dumps(sink.config.to_dict())


def test_mysql_urls_are_accepted_and_a_dead_server_is_reported(tmp_path, caplog):
    url = f"mysql+pymysql://alice:my-pw-123@127.0.0.1:{free_port()}/alerts"
    with caplog.at_level(logging.INFO, logger="mindmon"):
        sink = make_sink(tmp_path, {"rules": [NAN], "inform": {"connection_str": url, "timeout": 2,
                                                               "close_timeout": 1}})
        _anomalous_steps(sink, 2)
        sink.close()
    assert sink.reports[0].undelivered == {"connection refused": 1} and sink.reports[0].delivered == 0
    assert "mysql+pymysql://alice:***@127.0.0.1" in caplog.text and "my-pw-123" not in caplog.text
    assert "Can't connect to MySQL server" in sink.reports[0].errors[0]
    with pytest.raises(ConfigError, match=r"^alert.inform.connection_str: mssql\+pyodbc://u:\*\*\*@h/db: No module"):
        build_alert_sink(AlertConfig.parse("alert", {"rules": [NAN], "inform": {
            "connection_str": "mssql+pyodbc://u:pw9@h/db"}}), str(tmp_path), path="alert")


def email_inform(host, port, **extra):
    return {"recipient": "email", "send_email_address": "mindmon@example.org",
            "receive_email_address": ["oncall@example.org", "lead@example.org"], "send_email_username": SMTP_USER,
            "send_email_password": SMTP_PASSWORD, "smtp_server": host, "smtp_port": str(port), **extra}


def test_email_over_starttls_with_login(tmp_path, smtp_inbox, caplog):
    with caplog.at_level(logging.INFO, logger="mindmon"):
        sink = make_sink(tmp_path, {"rules": DB_RULES, "inform": email_inform(smtp_inbox.host, smtp_inbox.port)})
        _anomalous_steps(sink, 2)
        sink.close()
    assert sink.reports[0].delivered == 2
    assert smtp_inbox.logins == [(SMTP_USER, True)] and smtp_inbox.tls_sessions == 1
    assert smtp_inbox.envelopes == [("mindmon@example.org", ["oncall@example.org", "lead@example.org"])]
    message = smtp_inbox.messages[0]
    assert message["Subject"] == "mindmon: 2 anomalies on rank 0, step 2"
    body = message.get_payload(decode=True).decode()
    assert "Rule AnomalyTurbulence reports anomaly signal in ('device_norm/fc.weight', 'norm') at step 2" in body
    assert "Rule AnomalyNan reports anomaly signal in ('device_loss/loss', 'loss') at step 2" in body
    assert SMTP_PASSWORD not in caplog.text


def test_a_hanging_recipient_never_blocks_a_step(tmp_path, hanging_smtp, caplog):
    inform = email_inform("127.0.0.1", hanging_smtp.port, queue_size=2, timeout=30, close_timeout=0.5)
    with caplog.at_level(logging.INFO, logger="mindmon"):
        sink = make_sink(tmp_path, {"rules": [NAN], "inform": inform})
        sink.write([Record(1, None, 0, "loss", "loss", float("nan"))])
        assert hanging_smtp.accepted.wait(10)   # the delivery thread is now stuck in the SMTP greeting
        sink.write([Record(2, k, 0, "local_loss", "loss", float("nan")) for k in range(4)])
        sink.flush()
        # the step's write returned while the server still holds the connection unanswered
        assert not hanging_smtp.released.is_set() and len(sink.deliverers[0].buffer) == 5
        sink.close()
    report = sink.reports[0]
    assert (report.delivered, report.undelivered, report.spooled) == (0, {"close_timeout ran out": 5}, 5)
    assert "5 undelivered (close_timeout ran out: 5), 5 left in" in caplog.text
    assert "5 anomalies wait" not in caplog.text and "more than queue_size; the rest go to" in caplog.text


def test_actions_decide_after_the_step():
    actions = AlertActions(stop_on_anomaly=True, skip_nonfinite_update=True)
    sink = make_sink("/nonexistent", {"rules": [NAN], "stop_on_anomaly": True}, actions=actions)
    sink.write([Record(1, None, 0, "loss", "loss", 1.0)])
    assert not actions.should_stop()
    sink.write([Record(2, None, 0, "loss", "loss", float("inf"))])
    assert actions.should_stop() and "at step 2" in actions.reason
    assert [actions.should_skip_update(g) for g in (1.5, float("nan"), None, float("inf"))] == [False, True, True, True]
    assert not AlertActions().should_skip_update(float("nan")) and not AlertActions().should_stop()


def numpy_training(batches, lr=0.1, k=2):
    """float64 reference of K-micro-step SGD: per step (device_loss, |grad w|, |grad b|)."""
    w, b, out = np.full((3, 1), 0.5), np.zeros(1), []
    for x, y in batches:
        acc_w, acc_b, losses = np.zeros_like(w), np.zeros_like(b), []
        for xs, ys in zip(np.split(x.astype(np.float64), k), np.split(y.astype(np.float64), k)):
            diff = xs @ w + b - ys
            losses.append(np.mean(diff ** 2))
            acc_w += xs.T @ diff * 2 / diff.size / k
            acc_b += diff.sum(axis=0) * 2 / diff.size / k
        out.append((np.mean(losses), np.linalg.norm(acc_w), np.linalg.norm(acc_b)))
        w, b = w - lr * acc_w, b - lr * acc_b
    return out


def expected_anomalies(reference):
    """LossSpike (threshold 3, window 3, min_history 2) on device_loss and AnomalyTurbulence
    (threshold 2) on each device_norm, from their definitions; training stops after the first."""
    found = []
    for step in range(1, len(reference) + 1):
        earlier = np.array(reference[:step - 1])
        loss, norm_w, norm_b = reference[step - 1]
        for name, column, value in (("layer.weight", 1, norm_w), ("layer.bias", 2, norm_b)):
            if step > 1 and abs(value - earlier[:, column].mean()) > 2 * earlier[:, column].mean():
                found.append((step, f"device_norm/{name}", value))
        if step > 2 and loss > 3 * np.median(earlier[-3:, 0]):
            found.append((step, "device_loss/loss", loss))
        if found:
            return found
    return found


def plain_loop(tmp_path, alerts, actions=None, lr=0.1):
    """The README's plain loop (K = 2, SGD, no clipping) with the alert sink among the group's
    sinks: (group, train step), the group set up."""
    from mindspore import nn

    from mindmon import AccumulatingTrainStep, parse_sections
    from mindmon.core.factory import build
    from mindmon.core.group import MonitorGroup

    net = Regression()
    optimizer = nn.SGD(net.trainable_params(), learning_rate=lr)
    monitor = parse_sections({"monitor": {"output_dir": str(tmp_path), "train_state": {
        "local_loss": True, "device_norm": True, "device_loss": True}}})
    logger = logging.getLogger("mindmon")
    built = build(monitor, None, [p.name for p in optimizer.parameters], 0, logger, True, DataParallel())
    # every record the step writes reaches the alert sink, next to the usual ones
    group = MonitorGroup(built.monitors, built.sinks + [alerts], 0, logger, actions)
    train_step = AccumulatingTrainStep(net, optimizer, num_micro_steps=2, group=group, max_norm=0.0)
    group.setup()
    return group, train_step


def train_until_stop(tmp_path, config, batches):
    """The plain loop, stopping when the actions say so; returns (sink, steps run)."""
    from mindspore import Tensor

    from mindmon import split_batch

    actions = AlertActions.from_config(config)
    alerts = AlertSink(config, str(tmp_path), actions=actions)
    group, train_step = plain_loop(tmp_path, alerts, actions)
    for step, (x, y) in enumerate(batches, start=1):
        train_step(split_batch((Tensor(x), Tensor(y)), 2))
        group.flush(step)
        if group.should_stop():
            break
    group.close()
    return alerts, step


def test_end_to_end_plain_loop_to_postgresql_and_email(tmp_path, postgres_url, smtp_inbox, rng):
    from argparse import ArgumentParser

    from mindmon.features.alerts import analyse
    from mindmon.features.alerts.recipients import read_back_rows

    x, y = regression_data(rng)
    batches = [(x, y)] * 3 + [(x * 10, y * 10)] + [(x, y)] * 2     # step 4 blows up
    expected = expected_anomalies(numpy_training(batches[:4]))
    assert [(s, tag) for s, tag, _ in expected] == [(4, "device_norm/layer.weight"), (4, "device_norm/layer.bias"),
                                                    (4, "device_loss/loss")]
    connection_str = postgres_url.render_as_string(hide_password=False)
    config = AlertConfig.parse("monitor.alert", {
        "rules": [NAN, {"rule_name": "LossSpike", "args": {"threshold": 3, "window": 3, "min_history": 2}},
                  {"rule_name": "AnomalyTurbulence", "args": {"threshold": 2}}],
        "dump": True, "stop_on_anomaly": True,
        "inform": [{"recipient": "database", "connection_str": connection_str, "table": "e2e_alerts"},
                   email_inform(smtp_inbox.host, smtp_inbox.port)]})
    alerts, steps_run = train_until_stop(tmp_path, config, batches)
    assert steps_run == 4 and [r.delivered for r in alerts.reports] == [3, 3]
    rows = read_back_rows(connection_str, "e2e_alerts")
    assert [(r["step"], r["tag_name"]) for r in rows] == [(s, tag) for s, tag, _ in expected]
    for row, (_, _, value) in zip(rows, expected):
        assert row["value"] == pytest.approx(value, rel=1e-5)
    note = delivery_note(alerts)
    print("\n".join(note))
    assert note[0] == "alerts: 3 anomalies" and note[2].startswith("    id 1: step 4 device_norm/layer.weight norm=")
    body = smtp_inbox.messages[0].get_payload(decode=True).decode()
    print(f"e-mail received: {smtp_inbox.messages[0]['Subject']}\n{body}")
    assert smtp_inbox.messages[0]["Subject"] == "mindmon: 3 anomalies on rank 0, step 4"
    assert all(row["message"] in body for row in rows)
    parser = ArgumentParser()
    analyse.add_arguments(parser)
    assert analyse.run(parser.parse_args(["-d", str(tmp_path)])) == 0
    ordered = _read(tmp_path / "anomaly_detected" / "anomaly_analyse.json")
    assert [e["tag_name"] for e in ordered.values()] == [tag for _, tag, _ in expected]


AGREEMENT_WORKER = '''
import json, os, sys
import mindspore as ms
from mindspore.communication import init
ms.set_context(device_target="CPU")
init("mccl")
from mindmon.features.alerts import AlertActions, AlertConfig, AlertSink
from mindmon.parallel.data_parallel import DataParallel
from mindmon.core.records import Record

data_parallel = DataParallel()
rank = data_parallel.rank
config = AlertConfig.parse("alert", {"rules": [{"rule_name": "AnomalyNan"}], "stop_on_anomaly": True,
                                     "skip_nonfinite_update": True})
actions = AlertActions.from_config(config, data_parallel)
sink = AlertSink(config, sys.argv[1], rank=rank, actions=actions)
skipped, stopped_at = [], None
for step in range(1, 6):
    if actions.should_skip_update(float("nan") if (rank, step) == (0, 2) else 1.0):
        skipped.append(step)
    sink.write([Record(step, None, rank, "loss", "loss", float("nan") if (rank, step) == (1, 3) else 1.0)])
    if actions.should_stop():
        stopped_at = step
        break
with open(os.path.join(sys.argv[1], f"rank{rank}.json"), "w") as f:
    json.dump({"skipped": skipped, "stopped_at": stopped_at}, f)
'''


def test_every_rank_decides_the_same_way(tmp_path):
    """Two msrun processes: only rank 0 sees a NaN gradient norm (step 2) and only rank 1 an
    anomaly (step 3); both skip step 2's update and both stop after step 3."""
    import shutil

    from mindmon.demo.launch import _free_port

    worker = tmp_path / "worker.py"
    worker.write_text(AGREEMENT_WORKER)
    msrun = shutil.which("msrun", path=os.path.dirname(sys.executable)) or shutil.which("msrun")
    env = dict(os.environ, PYTHONPATH=os.getcwd(),
               PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))
    result = subprocess.run([msrun, "--worker_num=2", "--local_worker_num=2", f"--master_port={_free_port()}",
                             f"--log_dir={tmp_path / 'msrun'}", "--join=True", str(worker), str(tmp_path)],
                            capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)
    assert result.returncode == 0, result.stdout[-2000:]
    assert [_read(tmp_path / f"rank{r}.json") for r in (0, 1)] == [{"skipped": [2], "stopped_at": 3}] * 2
