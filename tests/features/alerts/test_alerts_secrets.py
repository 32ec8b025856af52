"""No password from `connection_str` or the e-mail settings reaches any output: every file a
successful run and a failed run leave (JSONL, CSV, dump, spool, run id), their logs (everything
logged, DEBUG included, SQLAlchemy's own loggers too), the closing note and the printed
configuration; a malformed URL; an SMTP server whose refusal echoes the password it was sent.
Each secret is looked for raw and in its URL-escaped forms."""
import json
import os
import subprocess
import sys
from urllib.parse import quote, quote_plus

import yaml

from tests.support.servers import MYSQL_PASSWORD, PG_PASSWORD, SMTP_PASSWORD, free_port
from tests.features.alerts.test_alerts_outages import url_text
from tests.features.alerts.test_alerts import email_inform

WRONG = {"postgresql": "pg-wr0ng@pw/x", "mysql": "my-wr0ng:pw@x", "smtp": "smtp-wr0ng-pw", "query": "q-s3cret-pw"}
RUN_JOB = '''
import json, logging, sys
logging.basicConfig(level=logging.DEBUG, stream=sys.stderr, format="%(name)s %(levelname)s %(message)s")
from mindmon.features.alerts import AlertConfig, delivery_note
from tests.features.alerts.test_alerts_outages import train
config = AlertConfig.parse("monitor.alert", json.load(open(sys.argv[2])))
print(repr(config), json.dumps(config.to_dict()))
alerts, steps, _ = train(sys.argv[1], config, lambda step: step < 4)
print("\\n".join(delivery_note(alerts)))
'''


def forms(secret):
    return {secret, quote(secret, safe=""), quote_plus(secret), quote(secret)}


def leaks(folder, texts, secrets):
    """(secret, where) for every occurrence in a file below `folder` or in one of `texts`."""
    found = []
    for root, _, files in os.walk(folder):
        for name in files:
            data = open(os.path.join(root, name), "rb").read()
            found += [(s, os.path.join(root, name)) for secret in secrets for s in forms(secret) if s.encode() in data]
    found += [(s, label) for label, text in texts.items() for secret in secrets for s in forms(secret) if s in text]
    return found


def run_job(tmp_path, name, alert):
    config = tmp_path / f"{name}.json"      # the user's own file, outside the run's folder
    config.write_text(json.dumps(alert))
    job = subprocess.run([sys.executable, "-c", RUN_JOB, str(tmp_path / name), str(config)], capture_output=True,
                         text=True, timeout=300, cwd=os.getcwd())
    assert job.returncode == 0, job.stderr[-3000:]
    return job


def test_no_password_in_anything_a_successful_and_a_failed_run_leave(tmp_path, postgres_server, mariadb_server,
                                                                   smtp_inbox):
    rules = [{"rule_name": "AnomalyNan", "args": {"threshold": 0.0}}]
    good = {"rules": rules, "dump": True, "inform": [
        {"connection_str": url_text(postgres_server.url)}, {"connection_str": url_text(mariadb_server.url)},
        email_inform(smtp_inbox.host, smtp_inbox.port)]}
    quick = {"timeout": 1, "close_timeout": 2, "retry_interval": 0.5}
    bad = {"rules": rules, "dump": True, "inform": [
        {"connection_str": url_text(postgres_server.url.set(password=WRONG["postgresql"])), **quick},
        {"connection_str": url_text(mariadb_server.url.set(password=WRONG["mysql"])), **quick},
        {"connection_str": f"postgresql+psycopg2://u@127.0.0.1:{free_port()}/db?password={WRONG['query']}", **quick},
        email_inform(smtp_inbox.host, smtp_inbox.port, send_email_password=WRONG["smtp"], **quick)]}
    succeeded, failed = run_job(tmp_path, "good", good), run_job(tmp_path, "bad", bad)
    print(succeeded.stdout[-1500:], failed.stdout[-1500:])
    assert succeeded.stdout.count(": 20 delivered") == 3 and smtp_inbox.logins[0][1]
    assert failed.stdout.count("authentication failed: 20") == 3 and "connection refused: 20" in failed.stdout
    assert f"password {WRONG['smtp']} refused" not in failed.stderr and "password *** refused" in failed.stderr
    assert os.listdir(tmp_path / "bad" / "anomaly_detected" / "rank0" / "spool")   # the spool is among the files
    secrets = [PG_PASSWORD, MYSQL_PASSWORD, SMTP_PASSWORD] + list(WRONG.values())
    outputs = {f"{name} {stream}": getattr(job, stream) for name, job in (("good", succeeded), ("bad", failed))
               for stream in ("stdout", "stderr")}
    assert leaks(tmp_path / "good", outputs, secrets) == [] and leaks(tmp_path / "bad", {}, secrets) == []


def test_a_malformed_url_is_refused_without_its_password(tmp_path):
    for url in ("postgresql://bob:s3cr@t-pw@127.0.0.1:5432/db", "postgresql://bob:hunter-2@db:notaport/x",
                "mysql+pymysql://bob:hunter-2@[::1/x"):
        config = tmp_path / "run.yaml"
        config.write_text(yaml.safe_dump({"monitor": {"alert": {"rules": [{"rule_name": "AnomalyNan"}],
                                                                "inform": {"connection_str": url}}}}))
        check = subprocess.run([sys.executable, "-m", "mindmon", "check-config", str(config)], capture_output=True,
                               text=True)
        print(check.stderr)
        assert check.returncode == 1 and "monitor.alert.inform.connection_str:" in check.stderr
        assert len(check.stderr.strip().splitlines()) == 1 and "Traceback" not in check.stderr
        assert leaks(tmp_path / "none", {"stderr": check.stderr + check.stdout}, ["hunter-2", "t-pw", "s3cr@t"]) == []
