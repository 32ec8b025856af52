"""The recipients of `alert.inform`: a database table (SQLAlchemy), e-mail (smtplib) and a webhook
(mindmon.features.alerts.webhook).

Each has `deliver(items)` (raises on any failure; the caller retries the same items), `batch_limit`
(how many items one call takes) and `min_interval` (seconds between two calls; e-mail's digest
interval). A database insert is idempotent: every row carries its anomaly's key under a unique
constraint, and a row whose key is already there is skipped, so a batch retried after a commit
whose answer was lost arrives once. Run events are rows of the same table, their facts as JSON in
`details`.
"""
import hashlib
import smtplib
import ssl
from datetime import datetime, timezone
from email.message import EmailMessage
from typing import List, Sequence

from mindmon.config import ConfigError
from mindmon.features.alerts.anomaly import KeyedAnomaly
from mindmon.features.alerts.inform import (DatabaseInform, DEFAULT_TABLE, EmailInform, WebhookInform, mask_secrets,
                                            masked_url)
from mindmon.features.alerts.render import body, title

KEY_COLUMN = "anomaly_key"
DETAILS_COLUMN = "details"


def _connect_args(inform: DatabaseInform) -> dict:
    """Each driver's own timeouts (each names them differently), so a dead or silent server fails
    the attempt after about `timeout` seconds instead of holding the delivery thread."""
    backend, timeout = inform.url.get_backend_name(), inform.options.timeout
    if backend == "sqlite":
        return {"timeout": timeout}
    if backend == "postgresql":
        return {"connect_timeout": max(1, round(timeout)), "keepalives": 1,
                "keepalives_idle": max(1, round(timeout)), "keepalives_interval": 1, "keepalives_count": 3}
    if backend == "mysql":   # pymysql: after connecting, reads wait `read_timeout` (forever by default)
        return {"connect_timeout": max(1, round(timeout)), "read_timeout": timeout, "write_timeout": timeout}
    return {}


def anomaly_table(metadata, name: str, details: bool = True):
    from sqlalchemy import Column, DateTime, Float, Integer, String, Table, Text

    return Table(name, metadata,
                 Column("id", Integer, primary_key=True, autoincrement=True),
                 Column("created_at", DateTime(timezone=True), nullable=False),
                 Column("run_id", String(64)), Column(KEY_COLUMN, String(64), nullable=False, unique=True),
                 Column("rank", Integer), Column("step", Integer), Column("micro_step", Integer),
                 Column("pp_stage", Integer), Column("vpp_stage", Integer), Column("call_id", Integer),
                 Column("tag_name", String(512)), Column("kind", String(128)), Column("name", String(512)),
                 Column("statistic", String(64)), Column("value", Float), Column("value_text", String(64)),
                 Column("rule_name", String(64)), Column("message", Text), Column("group_mates", Text),
                 *([Column(DETAILS_COLUMN, Text)] if details else []))


def insert_skipping_duplicates(connection, table, rows: List[dict]) -> None:
    """One INSERT of `rows` in which a row whose key is already in the table is skipped: PostgreSQL
    and SQLite `ON CONFLICT DO NOTHING`, MySQL/MariaDB `ON DUPLICATE KEY UPDATE` of the key to
    itself (unlike `INSERT IGNORE`, other errors still fail); elsewhere the keys present are
    selected first, in the same transaction."""
    dialect = connection.dialect.name
    if dialect == "postgresql":
        from sqlalchemy.dialects.postgresql import insert

        statement = insert(table).on_conflict_do_nothing(index_elements=[KEY_COLUMN])
    elif dialect == "sqlite":
        from sqlalchemy.dialects.sqlite import insert

        statement = insert(table).on_conflict_do_nothing(index_elements=[KEY_COLUMN])
    elif dialect in ("mysql", "mariadb"):
        from sqlalchemy.dialects.mysql import insert

        statement = insert(table)
        statement = statement.on_duplicate_key_update({KEY_COLUMN: statement.inserted[KEY_COLUMN]})
    else:
        from sqlalchemy import select

        keys = [row[KEY_COLUMN] for row in rows]
        present = set(connection.execute(select(table.c[KEY_COLUMN]).where(table.c[KEY_COLUMN].in_(keys))).scalars())
        rows, statement = [row for row in rows if row[KEY_COLUMN] not in present], table.insert()
    if rows:
        connection.execute(statement, rows)


class DatabaseRecipient:
    """Inserts anomalies as rows of one table (created if missing), one transaction per batch."""

    min_interval = 0.0

    def __init__(self, inform: DatabaseInform, path: str = "alert.inform"):
        from sqlalchemy import create_engine

        self.inform = inform
        self.batch_limit = inform.options.batch_size
        try:  # imports the driver but does not connect: a missing driver is a configuration error
            self.engine = create_engine(inform.url, connect_args=_connect_args(inform), pool_pre_ping=True)
        except Exception as error:
            raise ConfigError(f"{path}.connection_str: {masked_url(inform.url)}: "
                              f"{mask_secrets(str(error), inform.secrets())}; install the driver the URL "
                              f"names (e.g. psycopg2-binary, pymysql)") from None
        self.table = None
        self.has_details = True

    def _open_table(self):
        from sqlalchemy import MetaData, inspect

        metadata = MetaData()
        table = anomaly_table(metadata, self.inform.table)
        metadata.create_all(self.engine)
        columns = {column["name"] for column in inspect(self.engine).get_columns(self.inform.table)}
        if KEY_COLUMN not in columns:
            raise RuntimeError(f"table {self.inform.table} has no column {KEY_COLUMN} (made by an older mindmon): "
                               f"name a new table, or add the column (64 characters) with a unique index")
        # a table made before run events had details: events arrive without them (their message stays)
        self.has_details = DETAILS_COLUMN in columns
        return table if self.has_details else anomaly_table(MetaData(), self.inform.table, details=False)

    def deliver(self, items: Sequence[KeyedAnomaly]) -> None:
        if self.table is None:
            self.table = self._open_table()
        now = datetime.now(timezone.utc)
        rows = [{**item.anomaly.row(), "created_at": now, "run_id": item.run_id, KEY_COLUMN: item.key}
                for item in items]
        if not self.has_details:
            for row in rows:
                del row[DETAILS_COLUMN]
        with self.engine.begin() as connection:
            insert_skipping_duplicates(connection, self.table, rows)

    def close(self) -> None:
        self.engine.dispose()


def email_body(items: Sequence[KeyedAnomaly], listed: int) -> str:
    """The run events in full, then the anomalies counted by rule and tag and the first `listed` in full."""
    return body(items, listed)


class EmailRecipient:
    """One e-mail per call, over SMTP with STARTTLS when the server offers it (SMTPS on 465): a
    digest of every anomaly waiting, at most one per `email_interval`. The Message-ID is a hash of
    the anomalies' keys, so a digest sent again after a lost answer can be recognised."""

    batch_limit = 100000

    def __init__(self, inform: EmailInform, path: str = "alert.inform"):
        self.inform = inform
        self.min_interval = inform.options.email_interval
        self.listed = inform.options.email_listed

    def message(self, items: Sequence[KeyedAnomaly]) -> EmailMessage:
        message = EmailMessage()
        message["Subject"] = title(items)
        message["From"] = self.inform.send_email_address
        message["To"] = ", ".join(self.inform.receive_email_address)
        digest = hashlib.sha256("".join(item.key for item in items).encode()).hexdigest()[:32]
        message["Message-ID"] = f"<{digest}@mindmon>"
        message.set_content(email_body(items, self.listed))
        return message

    def deliver(self, items: Sequence[KeyedAnomaly]) -> None:
        inform, timeout = self.inform, self.inform.options.timeout
        if inform.smtp_port == 465:
            smtp = smtplib.SMTP_SSL(inform.smtp_server, inform.smtp_port, timeout=timeout,
                                    context=ssl.create_default_context())
        else:
            smtp = smtplib.SMTP(inform.smtp_server, inform.smtp_port, timeout=timeout)
        with smtp:
            smtp.ehlo()
            if inform.smtp_port != 465 and smtp.has_extn("starttls"):
                smtp.starttls(context=ssl.create_default_context())
                smtp.ehlo()
            if inform.send_email_username and inform.send_email_password and smtp.has_extn("auth"):
                smtp.login(inform.send_email_username, inform.send_email_password)
            smtp.send_message(self.message(items))

    def close(self) -> None:
        pass


def build_recipient(inform, path: str = "alert.inform"):
    if isinstance(inform, WebhookInform):
        from mindmon.features.alerts.webhook import WebhookRecipient

        return WebhookRecipient(inform, path)
    return (DatabaseRecipient if isinstance(inform, DatabaseInform) else EmailRecipient)(inform, path)


def read_back_rows(connection_str, table: str = DEFAULT_TABLE, limit: int = 20) -> List[dict]:
    """The last `limit` anomaly rows of a database recipient's table, oldest first (for a closing
    note or a check that delivery worked)."""
    from sqlalchemy import MetaData, Table, create_engine, select

    engine = create_engine(connection_str)
    try:
        rows_table = Table(table, MetaData(), autoload_with=engine)
        query = select(rows_table).order_by(rows_table.c.id.desc()).limit(limit)
        with engine.connect() as connection:
            rows = [dict(row._mapping) for row in connection.execute(query)]
    finally:
        engine.dispose()
    return rows[::-1]
