"""The webhook recipient against a receiver of the test's own (tests/support/webhook_receiver.py): each
template's body field by field, with Feishu's and DingTalk's signatures recomputed here from their
documented schemes; a storm cut to WeCom's size limit; one-line configuration errors; no secret (the
signing secret, the bot's token in the URL) in any file or log line."""
import base64
import hashlib
import hmac
import json
import logging
import os
import subprocess
import sys
import time

import pytest
import yaml

from mindmon.config import ConfigError
from mindmon.core.engine import RunInfo
from mindmon.features.alerts import AlertConfig, AlertSink
from mindmon.features.alerts.anomaly import KeyedAnomaly
from mindmon.features.alerts.recipients import build_recipient
from mindmon.core.records import Record
from tests.support.webhook_receiver import Receiver

FEISHU_SECRET, DINGTALK_SECRET = "fs-s3cret-Kq9", "SECdt-s3cret-77"
TOKEN = "tok3n-9f8e7d6c"     # the bot's credential in every URL's path or query
QUICK = {"webhook_interval": 0, "timeout": 2, "close_timeout": 10, "retry_interval": 0.2, "retry_max_interval": 0.5}


def records(step, names=5):
    """device_norm of p0..p<names-1>: 10 step + n + 1 (every one fires AnomalyNan with threshold 0)."""
    return [Record(step, None, 0, "device_norm", f"p{n}", float(step * 10 + n + 1)) for n in range(names)]


def key_of(run_id, rank, step, micro, tag, statistic):
    """The documented idempotency key: sha256 of the JSON list of run id, rank, step, micro-step, tag, statistic."""
    return hashlib.sha256(json.dumps([run_id, rank, step, micro, tag, statistic]).encode()).hexdigest()


def informs(base):
    return [{"recipient": "webhook", "template": "generic", "url": f"{base}/generic?token={TOKEN}", **QUICK},
            {"recipient": "webhook", "template": "slack", "url": f"{base}/slack/T0/B0/{TOKEN}", **QUICK},
            {"recipient": "webhook", "template": "feishu", "url": f"{base}/feishu/{TOKEN}", "secret": FEISHU_SECRET,
             **QUICK},
            {"recipient": "webhook", "template": "dingtalk", "url": f"{base}/dingtalk?access_token={TOKEN}",
             "secret": DINGTALK_SECRET, **QUICK},
            {"recipient": "webhook", "template": "wecom", "url": f"{base}/wecom?key={TOKEN}", **QUICK}]


def alert_section(inform, rules=None):
    return {"rules": rules or [{"rule_name": "AnomalyNan", "args": {"threshold": 0.0}}], "dump": True,
            "inform": inform}


def two_steps_and_a_crash(output_dir, run_id):
    """What a sink found in two steps (2 anomalies each) and a crash, as the delivery thread hands
    them to a recipient: in one batch, each with its key."""
    sink = AlertSink(AlertConfig.parse("monitor.alert", alert_section(None)), str(output_dir))
    sink.open(RunInfo(rank=0))
    for step in (1, 2):
        sink.write(records(step, 2))
        sink.flush()
    try:
        raise ValueError("loss <nan> & grad norm <inf>")
    except ValueError as error:
        sink.run_crashed(error)
    sink.close()
    return [KeyedAnomaly.of(run_id, anomaly) for anomaly in sink.recent]


def post_to_each_template(base, items):
    """One real POST of the batch per template, as the delivery thread makes it."""
    for section in informs(base):
        (inform,) = AlertConfig.parse("monitor.alert", alert_section(section)).inform
        build_recipient(inform).deliver(items)


EXPECTED_LINES = [
    "mindmon: 1 event (run crashed) and 4 anomalies on rank 0, steps 1-2",
    "",
    "Run events:",
    "- [crashed] run crashed on rank 0 at step 2: ValueError: loss <nan> & grad norm <inf>",
]
ANOMALY_LINES = [
    "4 anomalies detected by mindmon.",
    "",
    "By rule and tag:",
]


def check_chat_text(text):
    lines = text.split("\n")
    assert lines[:4] == EXPECTED_LINES, lines[:6]
    assert "    type: ValueError" in lines and "    exception: ValueError: loss <nan> & grad norm <inf>" in lines
    start = lines.index("4 anomalies detected by mindmon.")
    assert lines[start:start + 3] == ANOMALY_LINES
    assert sorted(lines[start + 3:start + 5]) == [f"        2  AnomalyNan  device_norm/p{n} norm" for n in range(2)]
    listed = [line for line in lines if line.startswith("- Rule AnomalyNan")]
    found = sorted((line.split("'")[1], int(line.split(" at step ")[1].split()[0])) for line in listed)
    assert found == sorted((f"device_norm/p{n}", step) for step in (1, 2) for n in range(2))


def test_each_template_posts_its_documented_body_with_its_signature(tmp_path):
    receiver, rid = Receiver(), "run-7f3a"
    items = two_steps_and_a_crash(tmp_path / "run", rid)
    try:
        before = time.time()
        post_to_each_template(receiver.base, items)
        after = time.time()
    finally:
        receiver.stop()

    # generic: every anomaly and the event with its key, the batch's hash as Idempotency-Key
    (generic,) = receiver.of("/generic")
    body = generic["body"]
    assert set(body) == {"source", "batch", "title", "count", "items"} and body["source"] == "mindmon"
    assert body["count"] == 5 and body["title"] == EXPECTED_LINES[0]
    want = [key_of(rid, 0, step, None, f"device_norm/p{n}", "norm") for step in (1, 2) for n in range(2)]
    anomalies = [item for item in body["items"] if item["type"] == "anomaly"]
    assert [item["key"] for item in anomalies] == want
    assert [(item["step"], item["name"], item["value"], item["rule_name"]) for item in anomalies] == \
        [(step, f"p{n}", float(step * 10 + n + 1), "AnomalyNan") for step in (1, 2) for n in range(2)]
    (event,) = [item for item in body["items"] if item["type"] == "event"]
    assert (event["kind"], event["rule_name"], event["step"], event["value"], event["run_id"]) == \
        ("crashed", "crashed", 2, 2.0, rid)
    assert event["details"]["exception"] == "ValueError: loss <nan> & grad norm <inf>"
    details_json = json.dumps(event["details"], sort_keys=True)
    assert event["key"] == hashlib.sha256(json.dumps([rid, 0, 2, None, "crashed", "step", details_json])
                                          .encode()).hexdigest()
    keys = "".join(item["key"] for item in body["items"])
    assert generic["headers"]["Idempotency-Key"] == hashlib.sha256(keys.encode()).hexdigest()[:32]
    assert generic["headers"]["Content-Type"].startswith("application/json")

    # a lone event is named in the title
    (generic_inform,) = AlertConfig.parse("monitor.alert", alert_section(informs(receiver.base)[0])).inform
    receiver.start()
    try:
        build_recipient(generic_inform).deliver([item for item in items if item.anomaly.is_event])
    finally:
        receiver.stop()
    assert receiver.bodies("/generic")[-1]["title"] == "mindmon: run crashed on rank 0, step 2"

    # slack: {"text": ...} with &, <, > as entities
    (slack,) = receiver.bodies("/slack")
    assert set(slack) == {"text"}
    assert "<" not in slack["text"] and "&lt;nan&gt; &amp; grad norm &lt;inf&gt;" in slack["text"]
    check_chat_text(slack["text"].replace("&lt;", "<").replace("&gt;", ">").replace("&amp;", "&"))

    # feishu: timestamp (seconds, a string) and sign = base64(HMAC-SHA256(key="<timestamp>\n<secret>", msg=""))
    (feishu,) = receiver.bodies("/feishu")
    assert set(feishu) == {"timestamp", "sign", "msg_type", "content"} and feishu["msg_type"] == "text"
    assert isinstance(feishu["timestamp"], str) and int(before) <= int(feishu["timestamp"]) <= after
    key = f"{feishu['timestamp']}\n{FEISHU_SECRET}".encode("utf-8")
    assert feishu["sign"] == base64.b64encode(hmac.new(key, b"", hashlib.sha256).digest()).decode()
    assert set(feishu["content"]) == {"text"}
    check_chat_text(feishu["content"]["text"])

    # dingtalk: timestamp (ms) and sign in the query: base64(HMAC-SHA256(key=secret, msg="<timestamp>\n<secret>"))
    (dingtalk,) = receiver.of("/dingtalk")
    query = dingtalk["query"]
    assert query["access_token"] == [TOKEN] and len(query["timestamp"]) == 1 and len(query["sign"]) == 1
    stamp = int(query["timestamp"][0])
    assert int(before * 1000) <= stamp <= int(after * 1000) + 1
    digest = hmac.new(DINGTALK_SECRET.encode(), f"{stamp}\n{DINGTALK_SECRET}".encode(), hashlib.sha256).digest()
    assert query["sign"][0] == base64.b64encode(digest).decode()   # parse_qs undid the URL-escaping
    raw_sign = dingtalk["raw_path"].split("sign=")[1]
    assert "+" not in raw_sign and "/" not in raw_sign and "=" not in raw_sign   # escaped as the scheme says
    assert dingtalk["body"]["msgtype"] == "text" and set(dingtalk["body"]) == {"msgtype", "text"}
    check_chat_text(dingtalk["body"]["text"]["content"])

    # wecom: {"msgtype": "text", "text": {"content": ...}}
    (wecom,) = receiver.of("/wecom")
    assert wecom["query"] == {"key": [TOKEN]} and set(wecom["body"]) == {"msgtype", "text"}
    assert wecom["body"]["msgtype"] == "text" and set(wecom["body"]["text"]) == {"content"}
    check_chat_text(wecom["body"]["text"]["content"])


def test_a_storm_is_one_digest_per_interval_cut_to_the_service_limit(tmp_path):
    receiver = Receiver()
    wecom = {"recipient": "webhook", "template": "wecom", "url": f"{receiver.base}/wecom?key={TOKEN}",
             **QUICK, "webhook_interval": 60, "webhook_listed": 1000}
    try:
        sink = AlertSink(AlertConfig.parse("monitor.alert", alert_section(wecom)), str(tmp_path))
        sink.open(RunInfo(rank=0))
        for step in range(1, 41):
            sink.write(records(step, 10))
        sink.close()
    finally:
        receiver.stop()
    bodies = receiver.bodies("/wecom")
    # the first batch goes at once; the interval holds the rest until the end, then they go at once
    assert 1 <= len(bodies) <= 2 and sink.reports[0].delivered == 400
    texts = [body["text"]["content"] for body in bodies]
    assert all(len(text.encode("utf-8")) <= 2048 for text in texts), [len(t.encode()) for t in texts]
    counts = [int(text.split("\n")[2].split()[0]) for text in texts]   # "N anomalies detected by mindmon."
    assert sum(counts) == 400
    assert all(text.split("\n")[-1].startswith("[") and "more lines cut" in text for text in texts if len(text) > 1800)


BAD = [
    ({"url": "https://x.example/h", "template": "teams"},
     "monitor.alert.inform.template: got 'teams' (str); allowed: one of ['generic', 'slack', 'feishu', 'dingtalk', 'wecom']"),
    ({"url": f"ftp://files.example/{TOKEN}"},
     "monitor.alert.inform.url: got ftp://files.example/***; allowed: an http:// or https:// URL with a host"),
    ({"url": f"hooks.slack.com/services/{TOKEN}", "template": "slack"},
     "monitor.alert.inform.url: got a URL without a scheme or host (value not shown: it may hold the bot's token); "
     "allowed: an http:// or https:// URL with a host"),
    ({"url": f"https://hooks.slack.com/services/{TOKEN}", "template": "slack", "secret": "abc-s3cret"},
     "monitor.alert.inform.secret: given for template 'slack', which does not sign (value not shown); "
     "allowed: a secret only with template feishu or dingtalk"),
    ({"url": "https://x.example/h", "template": "feishu", "secret": 12345},
     "monitor.alert.inform.secret: got a int; allowed: a non-empty string"),
    ({"url": "https://x.example/h", "events": ["crashed", "exploded"]},
     "monitor.alert.inform.events: got 'exploded' (str); allowed: run events from "
     "['started', 'finished', 'crashed', 'rank_lost', 'hang', 'slow_rank', 'throughput_drop']"),
    ({"url": "https://x.example/h", "webhook_interval": -1},
     "monitor.alert.inform.webhook_interval: got -1 (int); allowed: a number of seconds >= 0"),
    ({"template": "slack"}, "monitor.alert.inform.url: missing; recipient webhook needs the URL to post to"),
    ({"url": "https://x.example/h", "headers": {}},
     "monitor.alert.inform.headers: unknown key 'headers'"),
]


@pytest.mark.parametrize("inform, message", BAD)
def test_a_bad_webhook_is_one_line_naming_key_value_and_what_is_allowed(inform, message):
    with pytest.raises(ConfigError) as error:
        AlertConfig.parse("monitor.alert", alert_section({"recipient": "webhook", **inform}))
    text = str(error.value)
    assert "\n" not in text and text.startswith(message), text
    assert TOKEN not in text and "abc-s3cret" not in text


def test_check_config_prints_one_line_and_no_token(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump({"monitor": {"alert": alert_section(
        {"recipient": "webhook", "template": "wecom", "url": f"https://qyapi.example/send?key={TOKEN}",
         "secret": "w-s3cret"})}}))
    check = subprocess.run([sys.executable, "-m", "mindmon", "check-config", str(path)], capture_output=True,
                           text=True, timeout=120)
    assert check.returncode == 1 and "Traceback" not in check.stderr
    assert check.stderr.strip().splitlines() == [
        f"mindmon: {path}: monitor.alert.inform.secret: given for template 'wecom', which does not sign (value not "
        f"shown); allowed: a secret only with template feishu or dingtalk"], check.stderr
    assert TOKEN not in check.stderr + check.stdout and "w-s3cret" not in check.stderr + check.stdout


def test_no_secret_or_token_in_any_file_or_log_line(tmp_path, caplog):
    """A receiver that refuses with 403 and echoes what it was sent (the path with the token, the
    signature): the log, the spool, its sidecar, the dump and the printed configuration hold neither
    the signing secret nor the token."""
    receiver = Receiver()
    for path in ("/feishu/" + TOKEN, "/dingtalk"):
        receiver.answer[path] = (403, "")
    section = alert_section(
        [{"recipient": "webhook", "template": "feishu", "url": f"{receiver.base}/feishu/{TOKEN}",
          "secret": FEISHU_SECRET, **QUICK, "close_timeout": 1.5},
         {"recipient": "webhook", "template": "dingtalk", "url": f"{receiver.base}/dingtalk?access_token={TOKEN}",
          "secret": DINGTALK_SECRET, **QUICK, "close_timeout": 1.5}])

    caplog.set_level(logging.DEBUG)
    original = receiver.handle

    def echoing(handler):   # the refusal quotes the request line, token and signature included
        receiver.answer["/feishu/" + TOKEN] = (403, f"forbidden: POST {handler.path} secret={FEISHU_SECRET}")
        receiver.answer["/dingtalk"] = (403, f"forbidden: POST {handler.path} secret={DINGTALK_SECRET}")
        original(handler)

    receiver.handle = echoing
    try:
        config = AlertConfig.parse("monitor.alert", section)
        printed = repr(config) + json.dumps(config.to_dict())
        sink = AlertSink(config, str(tmp_path / "run"))
        sink.open(RunInfo(rank=0))
        sink.write(records(1, 3))
        sink.flush()
        sink.run_started(["train_state"])
        sink.close()
    finally:
        receiver.stop()
    assert [r.undelivered for r in sink.reports] == [{"HTTP 403": 3}, {"HTTP 403": 3}], \
        [r.summary() for r in sink.reports]
    assert any("forbidden: POST" in r.message for r in caplog.records)   # the refusal was logged, masked
    logged = "\n".join(r.getMessage() for r in caplog.records) + "\n".join(e for r in sink.reports for e in r.errors)
    files = b"".join(open(os.path.join(root, name), "rb").read() for root, _, names in os.walk(tmp_path / "run")
                     for name in names)
    assert os.listdir(tmp_path / "run" / "anomaly_detected" / "rank0" / "spool")   # the spool is among them
    for secret in (TOKEN, FEISHU_SECRET, DINGTALK_SECRET):
        assert secret not in logged and secret not in printed and secret.encode() not in files, secret
