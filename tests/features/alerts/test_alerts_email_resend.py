"""E-mail is at least once (SMTP has no idempotency key), and `mindmon alerts resend` never sends
again what was confirmed delivered: after a run that delivered everything it finds nothing to
send, and after a run killed (SIGKILL) mid-storm it sends only what the killed run had not had
confirmed by the server (the spool's `.delivered` position). Against a real aiosmtpd server."""
import os
import re
import signal
import subprocess
import sys
import time
from collections import Counter

import yaml

from tests.support.alert_email_worker import NAMES, step_records
from mindmon.features.alerts import AlertConfig, AlertSink
from tests.features.alerts.test_alerts import email_inform
from tests.support import HERE

RULE = {"rule_name": "AnomalyNan", "args": {"threshold": 0.0}}
LISTED = re.compile(r"- Rule AnomalyNan reports anomaly signal in \('device_norm/(p\d+)', 'norm'\) at step (\d+) ")


def listed(messages):
    """(tag, step) of every anomaly the e-mails list in full, one entry per listing."""
    found = []
    for message in messages:
        body = message.get_payload(decode=True).decode()
        found += [(name, int(step)) for name, step in LISTED.findall(body)]
    return found


def expected(steps):
    return {(f"p{n}", step) for step in steps for n in range(NAMES)}


def write_config(tmp_path, inbox, **extra):
    alert = {"rules": [RULE], "inform": email_inform(inbox.host, inbox.port, email_listed=100000, **extra)}
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump({"monitor": {"alert": alert}}))
    return path, alert


def resend(run_dir, config_path):
    done = subprocess.run([sys.executable, "-m", "mindmon", "alerts", "resend", str(run_dir), "--config",
                           str(config_path)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_resend_after_a_run_that_delivered_everything_sends_no_mail(tmp_path, smtp_inbox):
    config_path, alert = write_config(tmp_path, smtp_inbox, email_interval=0.5)
    sink = AlertSink(AlertConfig.parse("monitor.alert", alert), str(tmp_path / "run"))
    for step in range(1, 11):
        sink.write(step_records(step))
        time.sleep(0.1)
    sink.close()
    sent = len(smtp_inbox.messages)
    assert sink.reports[0].delivered == 10 * NAMES and sent >= 2
    assert Counter(listed(smtp_inbox.messages)) == Counter(expected(range(1, 11)))   # each once
    out = resend(tmp_path / "run", config_path)
    assert "nothing to resend" in out and len(smtp_inbox.messages) == sent


def test_resend_after_a_killed_run_sends_only_what_was_not_confirmed(tmp_path, smtp_inbox):
    """Everything goes through the spool (queue_size 1); one digest a second; the process is killed
    half a second after the server took its second digest, so that both were confirmed."""
    config_path, _ = write_config(tmp_path, smtp_inbox, email_interval=1, queue_size=1)
    worker = subprocess.Popen([sys.executable, os.path.join(HERE, "alert_email_worker.py"), str(tmp_path / "run"),
                               str(config_path)], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                              env={**os.environ, "PYTHONPATH": os.pathsep.join([HERE] + sys.path)})
    try:
        deadline = time.monotonic() + 60
        while len(smtp_inbox.messages) < 2 and time.monotonic() < deadline and worker.poll() is None:
            time.sleep(0.01)
        time.sleep(0.5)
    finally:
        worker.send_signal(signal.SIGKILL)
        reported = worker.communicate()[0].count("step ")
    before = listed(smtp_inbox.messages)
    assert len(smtp_inbox.messages) == 2, "the worker did not deliver two digests in time"
    out = resend(tmp_path / "run", config_path)
    after = listed(smtp_inbox.messages[2:])
    print(f"\n[e-mail resend] killed after {reported} steps; {len(before)} anomalies in 2 digests before the kill, "
          f"{len(after)} in {len(smtp_inbox.messages) - 2} sent by resend; resend said: {out.strip()}")
    assert after and not set(after) & set(before)              # nothing confirmed is sent again
    everything = Counter(before + after)
    assert set(everything.values()) == {1}
    found = expected(range(1, reported + 2))                   # the step in flight at the kill may be spooled
    assert set(everything) <= found
    # Memory holds at most queue_size (1) anomaly, and only while the spool has nothing unread (each digest
    # drains it): that one is lost with the process; everything else reported is in a mail or resent.
    assert len(expected(range(1, reported + 1)) - set(everything)) <= 1
    assert "nothing to resend" in resend(tmp_path / "run", config_path)
