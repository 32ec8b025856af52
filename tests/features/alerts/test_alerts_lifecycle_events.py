"""Run events (started, finished, crashed, rank_lost, hang, slow_rank) through every recipient: a
real PostgreSQL (tests/support/servers.py) with the default events (crashed, rank_lost, hang), a generic
webhook and a Feishu bot (tests/support/webhook_receiver.py) told of all six, e-mail (aiosmtpd) told of
started and crashed. Each recipient gets exactly the events it chose, each once, rendered as it
reads them: a row with its facts as JSON, a webhook item with its key, a line and its facts in a chat
message and in an e-mail."""
import json
import time

from mindmon.core.engine import RunInfo
from mindmon.features.alerts import AlertConfig, AlertSink
from mindmon.features.alerts.anomaly import KeyedAnomaly
from mindmon.features.alerts.recipients import build_recipient
from mindmon.parallel.watchdog import Hang
from mindmon.core.progress import Place
from tests.features.alerts.test_alerts_webhook import key_of, records
from tests.features.alerts.test_alerts import email_inform
from tests.support.webhook_receiver import Receiver

TABLE = "lifecycle_events"
QUICK = {"timeout": 2, "close_timeout": 15, "retry_interval": 0.2, "retry_max_interval": 0.5}
ALL = ["started", "finished", "crashed", "rank_lost", "hang", "slow_rank"]
LOST_LINE = "mindmon: rank 3 stopped answering (its process ended; last seen at step 3); this job cannot go on"
HANG_LINE = "mindmon: hang: no rank has progressed for 12.5 s (hang_after 10 s); rank 1 is in data of step 3"


def fresh_table(url):
    from sqlalchemy import create_engine, text

    engine = create_engine(url)
    with engine.begin() as connection:
        connection.execute(text(f"DROP TABLE IF EXISTS {TABLE}"))
    engine.dispose()


def select(url, sql):
    from sqlalchemy import create_engine, text

    engine = create_engine(url)
    try:
        with engine.connect() as connection:
            return [dict(row._mapping) for row in connection.execute(text(sql))]
    finally:
        engine.dispose()


def a_hang():
    now = time.time()
    places = {0: Place(3, "reduce", now - 12.5), 1: Place(3, "data", now - 12.5), 2: Place(3, "reduce", now - 12.5)}
    return Hang(1, 12.5, 10.0, places, (3, "reduce"), (1,), "/run/rank_*/hang_1_stacks.txt", HANG_LINE)


def run_with_every_event(output_dir, section):
    """Started; steps 1-3 (anomalies at steps 2 and 3: 21, 22, 31, 32 > 15); a slow rank, a hang and
    a lost rank at step 3; a crash; finished (a front door reports one or the other; here both, to
    render both)."""
    sink = AlertSink(AlertConfig.parse("monitor.alert", section), str(output_dir))
    sink.open(RunInfo(rank=0, max_steps=10))
    sink.run_started(["train_state", "alert"], layout="dp 2 x tp 1", hosts=["node-a", "node-b"], world_size=4,
                     max_steps=10)
    for step in (1, 2, 3):
        sink.write(records(step, 2))
        sink.flush()
    sink.slow_rank(2, 3, 2.5, 0.5, phase="data")
    sink.hang(a_hang())
    sink.rank_lost([3], LOST_LINE, step=3)
    try:
        raise RuntimeError("device memory exhausted\nwhile allocating 2 GiB")
    except RuntimeError as error:
        sink.run_crashed(error)
    sink.run_finished(3, reason="stopped on an anomaly")
    sink.close()
    return sink


def test_every_recipient_gets_the_events_it_chose_once_rendered_for_it(tmp_path, postgres_url, smtp_inbox):
    url = postgres_url.render_as_string(hide_password=False)
    fresh_table(url)
    receiver = Receiver()
    section = {"rules": [{"rule_name": "AnomalyNan", "args": {"threshold": 15.0}}], "dump": True, "inform": [
        {"connection_str": url, "table": TABLE, **QUICK},
        {"recipient": "webhook", "url": f"{receiver.base}/generic", "events": ALL, **QUICK},
        {"recipient": "webhook", "template": "feishu", "url": f"{receiver.base}/feishu/t0ken", "secret": "s3c",
         "events": ALL, "webhook_interval": 0.2, **QUICK},
        email_inform(smtp_inbox.host, smtp_inbox.port, events=["started", "crashed"], email_interval=0.2, **QUICK)]}
    try:
        sink = run_with_every_event(tmp_path, section)
    finally:
        receiver.stop()
    assert [r.delivered for r in sink.reports] == [4 + 3, 4 + 6, 4 + 6, 4 + 2], [r.summary() for r in sink.reports]
    assert sink.count == 4 and sink.events == 6

    # PostgreSQL: the anomalies and the default events, each one row
    rows = select(url, f"SELECT * FROM {TABLE} ORDER BY id")
    events = [row for row in rows if row["details"] is not None]
    assert [row["kind"] for row in rows if row["details"] is None] == ["device_norm"] * 4
    assert [(r["kind"], r["tag_name"], r["name"], r["rule_name"], r["rank"], r["step"], r["statistic"], r["value"])
            for r in events] == [("hang", "hang", "hang", "hang", 1, 3, "seconds", 12.5),
                                 ("rank_lost", "rank_lost", "rank_lost", "rank_lost", 3, 3, "ranks", 1.0),
                                 ("crashed", "crashed", "crashed", "crashed", 0, 3, "step", 3.0)]
    hang, lost, crashed = (json.loads(row["details"]) for row in events)
    assert {k: v for k, v in hang.items() if k != "at"} == {
        "number": 1, "stalled_seconds": 12.5, "hang_after_seconds": 10.0, "odd_ranks": [1],
        "majority": {"step": 3, "phase": "reduce"}, "stacks": "/run/rank_*/hang_1_stacks.txt"}
    assert events[0]["message"] == HANG_LINE and events[1]["message"] == LOST_LINE
    assert lost["lost_ranks"] == [3] and lost["finding"] == LOST_LINE
    assert crashed["exception"] == "RuntimeError: device memory exhausted while allocating 2 GiB"
    assert crashed["type"] == "RuntimeError"
    assert events[2]["message"] == ("run crashed on rank 0 at step 3: RuntimeError: device memory exhausted while "
                                    "allocating 2 GiB")
    assert len({row["anomaly_key"] for row in rows}) == len(rows) == 7

    # delivered once: the same batch again (a retry after a lost answer, a resend) adds no row
    (inform, *_) = AlertConfig.parse("monitor.alert", section).inform
    again = build_recipient(inform)
    run_id = rows[0]["run_id"]
    again.deliver([KeyedAnomaly(run_id, row["anomaly_key"], anomaly) for row, anomaly in
                   zip(events, [a for a in sink.recent if a.kind in ("hang", "rank_lost", "crashed")])])
    again.close()
    assert len(select(url, f"SELECT id FROM {TABLE}")) == 7

    # the generic webhook: all six, in the order reported, each key once, facts in full
    items = [item for body in receiver.bodies("/generic") for item in body["items"]]
    event_items = [item for item in items if item["type"] == "event"]
    assert [item["kind"] for item in event_items] == ["started", "slow_rank", "hang", "rank_lost", "crashed",
                                                      "finished"]
    assert len({item["key"] for item in items}) == len(items) == 10
    assert [item["key"] for item in items if item["type"] == "anomaly"] == \
        [key_of(run_id, 0, step, None, f"device_norm/p{n}", "norm") for step in (2, 3) for n in range(2)]
    started, slow, _, _, _, finished = event_items
    assert (started["step"], started["value"], started["statistic"]) == (0, 4.0, "ranks")
    assert started["details"]["monitored"] == ["train_state", "alert"] and started["details"]["world_size"] == 4
    assert started["details"]["hosts"] == ["node-a", "node-b"] and started["details"]["layout"] == "dp 2 x tp 1"
    assert set(started["details"]["versions"]) >= {"Python", "mindmon", "MindSpore"}
    assert started["message"].startswith("run started on rank 0: monitoring train_state, alert; layout dp 2 x tp 1; "
                                         "4 ranks; hosts node-a, node-b; Python ")
    assert (slow["rank"], slow["step"], slow["value"]) == (2, 3, 2.5)
    assert {k: slow["details"][k] for k in ("seconds", "median_seconds", "phase")} == \
        {"seconds": 2.5, "median_seconds": 0.5, "phase": "data"}
    assert slow["message"] == "rank 2 is slow at step 3: 2.5 s against a median of 0.5 s"
    assert (finished["step"], finished["value"], finished["details"]["reason"]) == (3, 3.0, "stopped on an anomaly")
    assert finished["message"] == "run finished on rank 0 after step 3 (stopped on an anomaly)"

    # Feishu: each event's line and facts in the text, each event in one message only
    texts = [body["content"]["text"] for body in receiver.bodies("/feishu")]
    for line in ("- [started] run started on rank 0: monitoring train_state, alert;", f"- [hang] {HANG_LINE}",
                 f"- [rank_lost] {LOST_LINE}", "- [slow_rank] rank 2 is slow at step 3",
                 "- [crashed] run crashed on rank 0 at step 3: RuntimeError: device memory exhausted",
                 "- [finished] run finished on rank 0 after step 3 (stopped on an anomaly)"):
        assert sum(text.count(line) for text in texts) == 1, (line, texts)
    assert any("    hosts: node-a, node-b" in text.split("\n") for text in texts)

    # e-mail: started and crashed only, the subject naming an event that a mail carries alone
    bodies = [message.get_payload(decode=True).decode() for message in smtp_inbox.messages]
    everything = "\n".join(bodies)
    assert everything.count("- [started] ") == 1 and everything.count("- [crashed] ") == 1
    assert "[hang]" not in everything and "[finished]" not in everything and "[slow_rank]" not in everything
    assert "    exception: RuntimeError: device memory exhausted while allocating 2 GiB" in everything.splitlines()
    # how the mails were batched depends on the delivery thread's timing; each subject must name its own mail
    for message, body in zip(smtp_inbox.messages, bodies):
        assert " ".join(message["Subject"].split()) == expected_subject(body)


def expected_subject(body):
    """The documented subject of a mail from its body: a lone event by name; otherwise the events
    (named, in order) and the anomalies counted, with the steps they span (started: 0, crashed: 3)."""
    lines = body.splitlines()
    kinds = [line[3:line.index("]")] for line in lines if line.startswith("- [")]
    steps = [{"started": 0, "crashed": 3}[kind] for kind in kinds]
    anomalies = [line for line in lines if line.startswith("- Rule AnomalyNan")]
    steps += [int(line.split(" at step ")[1].split()[0]) for line in anomalies]
    span = f"step {steps[0]}" if len(set(steps)) == 1 else f"steps {min(steps)}-{max(steps)}"
    names = [f"run {kind}" for kind in kinds]
    if len(kinds) == 1 and not anomalies:
        return f"mindmon: {names[0]} on rank 0, {span}"
    parts = [f"{len(kinds)} event{'s' if len(kinds) > 1 else ''} ({', '.join(names)})"] if kinds else []
    parts += [f"{len(anomalies)} anomal{'ies' if len(anomalies) > 1 else 'y'}"] if anomalies else []
    return f"mindmon: {' and '.join(parts)} on rank 0, {span}"


def test_the_watchdogs_positional_call_still_makes_the_row_it_made(tmp_path, postgres_url):
    """`report_event(kind, rank, step, value, message)` as the peer watchdog's hang handler calls it."""
    url = postgres_url.render_as_string(hide_password=False)
    fresh_table(url)
    section = {"rules": [{"rule_name": "AnomalyNan"}], "inform": {"connection_str": url, "table": TABLE, **QUICK}}
    sink = AlertSink(AlertConfig.parse("monitor.alert", section), str(tmp_path))
    sink.open(RunInfo(rank=0))
    sink.report_event("hang", 2, 7, 11.25, HANG_LINE)
    sink.close()
    rows = select(url, f"SELECT rank, step, kind, tag_name, statistic, value, rule_name, message FROM {TABLE}")
    assert rows == [{"rank": 2, "step": 7, "kind": "hang", "tag_name": "hang", "statistic": "seconds",
                     "value": 11.25, "rule_name": "hang", "message": HANG_LINE}]
