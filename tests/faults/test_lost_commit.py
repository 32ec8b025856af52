"""A commit whose answer is lost, made for real: a TCP proxy (tests/support/fault_proxy.py) between
mindmon and a real PostgreSQL / MariaDB forwards the COMMIT of an insert, waits for the server's
answer (the rows are committed), and drops the connection without passing the answer on. mindmon
sees a failed attempt, retries the same batch, and the table holds every anomaly exactly once."""
import pytest

from mindmon.features.alerts import AlertConfig, AlertSink
from mindmon.core.records import Record
from tests.support.fault_proxy import MYSQL_COMMIT, POSTGRES_COMMIT, LostCommitProxy
from tests.features.alerts.test_alerts_outages import EVERY_VALUE, QUICK_RETRY, select_rows, url_text

STEPS, NAMES, LOST = 12, 10, 3


def step_records(step):
    return [Record(step, None, 0, "device_norm", f"layers.{n}.weight", float(step * 100 + n + 1)) for n in range(NAMES)]


@pytest.mark.parametrize("server_name", ["postgres_server", "mariadb_server"])
def test_a_commit_whose_answer_is_lost_is_retried_and_each_anomaly_is_in_the_table_once(
        server_name, request, tmp_path):
    server = request.getfixturevalue(server_name)
    commit, accepted = (POSTGRES_COMMIT, b"C\x00\x00\x00\x0bCOMMIT\x00") if server_name == "postgres_server" \
        else (MYSQL_COMMIT, None)
    proxy = LostCommitProxy(server.port, commit, lose=LOST)
    table = f"lost_commit_{server_name.split('_')[0]}"
    through_proxy = server.url.set(port=proxy.port)
    config = AlertConfig.parse("monitor.alert", {"rules": [EVERY_VALUE], "inform": {
        "connection_str": url_text(through_proxy), "table": table, "batch_size": 25, **QUICK_RETRY}})
    sink = AlertSink(config, str(tmp_path))
    try:
        for step in range(1, STEPS + 1):
            sink.write(step_records(step))
        sink.close()
    finally:
        proxy.close()
    report = sink.reports[0]
    print(f"\n[lost commit] {server_name}: {report.summary()}; {proxy.connections} connections; lost answers: "
          f"{[answer[:16] for answer in proxy.lost_answers]}")
    assert len(proxy.lost_answers) == LOST
    for answer in proxy.lost_answers:   # the server did commit: its answer said so, and the client never saw it
        assert answer.startswith(accepted) if accepted else answer[4] == 0x00   # MySQL: an OK packet
    assert report.failed_attempts == LOST and report.delivered == STEPS * NAMES and report.complete
    rows = select_rows(url_text(server.url), table)
    expected = [(step, None, f"device_norm/layers.{n}.weight", "norm") for step in range(1, STEPS + 1)
                for n in range(NAMES)]
    assert [row[:4] for row in rows] == expected           # each once, in the order found
    assert len({row[4] for row in rows}) == len(expected)
