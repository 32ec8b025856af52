"""`alert.inform`: delivering anomalies to a database (SQLAlchemy) or by e-mail (SMTP), off the
training thread.

The sink hands anomalies to a `Deliverer`: a bounded queue and one daemon thread. `submit` never
blocks (a full queue drops and counts); the thread sends what is queued in batches; `close` waits
at most `close_timeout` seconds, then reports what was delivered, failed, dropped or left behind.
Passwords (in `connection_str` and `send_email_password`) are masked in everything it logs.
"""
import logging
import queue
import smtplib
import ssl
import threading
from dataclasses import dataclass, field
from datetime import datetime, timezone
from email.message import EmailMessage
from typing import Any, Dict, List, Optional, Sequence, Tuple

from mindmon.config import ConfigError, check_keys, is_int, type_error, value_error
from mindmon.features.alerts.anomaly import Anomaly

MASK = "***"
DEFAULT_TABLE = "mindmon_anomalies"
COMMON_KEYS = ("recipient", "queue_size", "timeout", "close_timeout")
DATABASE_KEYS = COMMON_KEYS + ("connection_str", "table")
EMAIL_KEYS = COMMON_KEYS + ("send_email_address", "receive_email_address", "send_email_username",
                            "send_email_password", "smtp_server", "smtp_port")
BATCH = 100  # anomalies per database transaction / per e-mail


def mask_secrets(text: str, secrets: Sequence[str]) -> str:
    """`text` with every secret (and its URL-quoted form) replaced by `***`."""
    from urllib.parse import quote, quote_plus

    for secret in secrets:
        if secret:
            for form in {secret, quote(secret, safe=""), quote_plus(secret)}:
                text = text.replace(form, MASK)
    return text


def masked_url(url: Any) -> str:
    """The URL as SQLAlchemy renders it with the password hidden."""
    return url.render_as_string(hide_password=True)


@dataclass(frozen=True)
class DeliveryOptions:
    queue_size: int = 1000        # anomalies waiting for the thread; more are dropped and counted
    timeout: float = 10.0         # seconds for one connection (SMTP socket, database connect)
    close_timeout: float = 30.0   # seconds `close` waits for the queue to drain

    @classmethod
    def parse(cls, path: str, section: Dict[str, Any]) -> "DeliveryOptions":
        out = {}
        if "queue_size" in section:
            value = section["queue_size"]
            if not is_int(value) or value < 1:
                raise type_error(f"{path}.queue_size", value, "a positive int")
            out["queue_size"] = value
        for key in ("timeout", "close_timeout"):
            if key in section:
                value = section[key]
                if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf"):
                    raise type_error(f"{path}.{key}", value, "a positive number of seconds")
                out[key] = float(value)
        return cls(**out)

    def to_dict(self) -> dict:
        return {"queue_size": self.queue_size, "timeout": self.timeout, "close_timeout": self.close_timeout}


@dataclass(frozen=True)
class DatabaseInform:
    url: Any = field(repr=False)   # sqlalchemy.engine.URL (holds the password)
    table: str = DEFAULT_TABLE
    options: DeliveryOptions = DeliveryOptions()

    def __repr__(self) -> str:
        return f"DatabaseInform({masked_url(self.url)!r}, table={self.table!r})"

    def describe(self) -> str:
        return f"database {masked_url(self.url)} (table {self.table})"

    def secrets(self) -> Tuple[str, ...]:
        return (self.url.password,) if self.url.password else ()

    def to_dict(self) -> dict:
        return {"recipient": "database", "connection_str": masked_url(self.url), "table": self.table,
                **self.options.to_dict()}


@dataclass(frozen=True)
class EmailInform:
    send_email_address: str
    receive_email_address: Tuple[str, ...]
    smtp_server: str
    smtp_port: int = 587
    send_email_username: Optional[str] = None
    send_email_password: Optional[str] = field(default=None, repr=False)
    options: DeliveryOptions = DeliveryOptions()

    def describe(self) -> str:
        return f"e-mail to {', '.join(self.receive_email_address)} via {self.smtp_server}:{self.smtp_port}"

    def secrets(self) -> Tuple[str, ...]:
        return (self.send_email_password,) if self.send_email_password else ()

    def to_dict(self) -> dict:
        return {"recipient": "email", "send_email_address": self.send_email_address,
                "receive_email_address": list(self.receive_email_address),
                "send_email_username": self.send_email_username,
                "send_email_password": MASK if self.send_email_password else None,
                "smtp_server": self.smtp_server, "smtp_port": self.smtp_port, **self.options.to_dict()}


def _parse_url(path: str, value: Any):
    try:
        from sqlalchemy.engine import make_url
    except ImportError:
        raise ConfigError(f"{path}: a database recipient needs SQLAlchemy; install mindmon[alerts]") from None
    if not isinstance(value, str) or not value:
        raise ConfigError(f"{path}: got a {type(value).__name__}; allowed: an SQLAlchemy URL string, "
                          f"e.g. postgresql+psycopg2://user:password@host:5432/db or sqlite:///alerts.db")
    try:
        return make_url(value)
    except Exception:  # the message would echo the URL, password included
        raise ConfigError(f"{path}: not an SQLAlchemy URL (value not shown: it may hold a password); allowed: "
                          f"dialect+driver://user:password@host:port/database, special characters in the "
                          f"password %-escaped") from None


def _text(path: str, value: Any, secret: bool = False) -> str:
    if not isinstance(value, str) or not value:
        shown = f"a {type(value).__name__}" if secret else repr(value)
        raise ConfigError(f"{path}: got {shown}; allowed: a non-empty string")
    return value


def _port(path: str, value: Any) -> int:
    port = int(value) if isinstance(value, str) and value.isdigit() else value
    if not is_int(port) or not 0 < port < 65536:
        raise value_error(path, value, "a port number 1..65535 (an int or a string of digits)")
    return port


def _receivers(path: str, value: Any) -> Tuple[str, ...]:
    values = [value] if isinstance(value, str) else value
    if not isinstance(values, list) or not values or not all(isinstance(v, str) and "@" in v for v in values):
        raise type_error(path, value, "an e-mail address or a non-empty list of them")
    return tuple(values)


def _parse_email(path: str, section: Dict[str, Any]) -> EmailInform:
    for key in ("send_email_address", "receive_email_address", "smtp_server"):
        if key not in section:
            raise ConfigError(f"{path}.{key}: missing; recipient email needs {key}")
    optional = {}
    if section.get("send_email_username") is not None:
        optional["send_email_username"] = _text(f"{path}.send_email_username", section["send_email_username"])
    if section.get("send_email_password") is not None:
        optional["send_email_password"] = _text(f"{path}.send_email_password", section["send_email_password"],
                                                secret=True)
    if "smtp_port" in section:
        optional["smtp_port"] = _port(f"{path}.smtp_port", section["smtp_port"])
    return EmailInform(_text(f"{path}.send_email_address", section["send_email_address"]),
                       _receivers(f"{path}.receive_email_address", section["receive_email_address"]),
                       _text(f"{path}.smtp_server", section["smtp_server"]),
                       options=DeliveryOptions.parse(path, section), **optional)


def _parse_one(path: str, section: Any):
    if not isinstance(section, dict):
        raise type_error(path, section, 'a mapping with "recipient": "database" or "email"')
    recipient = section.get("recipient", "database")  # kj600's default
    if recipient not in ("database", "email"):
        raise value_error(f"{path}.recipient", recipient, '"database" or "email"')
    if recipient == "email":
        return _parse_email(path, check_keys(path, section, EMAIL_KEYS))
    section = check_keys(path, section, DATABASE_KEYS)
    if "connection_str" not in section:
        raise ConfigError(f"{path}.connection_str: missing; recipient database needs an SQLAlchemy URL")
    table = section.get("table", DEFAULT_TABLE)
    if not isinstance(table, str) or not table.replace("_", "").isalnum():
        raise value_error(f"{path}.table", table, "a table name of letters, digits and _")
    return DatabaseInform(_parse_url(f"{path}.connection_str", section["connection_str"]), table,
                          DeliveryOptions.parse(path, section))


def parse_inform(path: str, value: Any) -> tuple:
    """`inform`: one recipient mapping, a list of them, or None (no delivery)."""
    if value is None:
        return ()
    if isinstance(value, list):
        return tuple(_parse_one(f"{path}[{i}]", item) for i, item in enumerate(value))
    return (_parse_one(path, value),)


def _connect_args(inform: DatabaseInform) -> dict:
    """The driver's own connect timeout (each names it differently), so a dead server fails the
    batch after `timeout` seconds instead of holding the delivery thread."""
    backend, timeout = inform.url.get_backend_name(), inform.options.timeout
    if backend == "sqlite":
        return {"timeout": timeout}
    if backend in ("postgresql", "mysql"):
        return {"connect_timeout": max(1, int(timeout))}
    return {}


class DatabaseRecipient:
    """Inserts anomalies as rows of one table (created if missing), one transaction per batch."""

    def __init__(self, inform: DatabaseInform, path: str = "alert.inform"):
        from sqlalchemy import create_engine

        self.inform = inform
        try:  # imports the driver but does not connect: a missing driver is a configuration error
            self.engine = create_engine(inform.url, connect_args=_connect_args(inform), pool_pre_ping=True)
        except Exception as error:
            raise ConfigError(f"{path}.connection_str: {masked_url(inform.url)}: "
                              f"{mask_secrets(str(error), inform.secrets())}; install the driver the URL "
                              f"names (e.g. psycopg2-binary, pymysql)") from None
        self.table = None

    def _create_table(self):
        from sqlalchemy import Column, DateTime, Float, Integer, MetaData, String, Table, Text

        metadata = MetaData()
        table = Table(self.inform.table, metadata,
                      Column("id", Integer, primary_key=True, autoincrement=True),
                      Column("created_at", DateTime(timezone=True), nullable=False),
                      Column("rank", Integer), Column("step", Integer), Column("micro_step", Integer),
                      Column("pp_stage", Integer), Column("vpp_stage", Integer), Column("call_id", Integer),
                      Column("tag_name", String(512)), Column("kind", String(128)), Column("name", String(512)),
                      Column("statistic", String(64)), Column("value", Float), Column("value_text", String(64)),
                      Column("rule_name", String(64)), Column("message", Text), Column("group_mates", Text))
        metadata.create_all(self.engine)
        return table

    def deliver(self, anomalies: List[Anomaly]) -> None:
        if self.table is None:
            self.table = self._create_table()
        now = datetime.now(timezone.utc)
        with self.engine.begin() as connection:
            connection.execute(self.table.insert(), [{**a.row(), "created_at": now} for a in anomalies])

    def close(self) -> None:
        self.engine.dispose()


def email_body(anomalies: Sequence[Anomaly]) -> str:
    lines = [f"{len(anomalies)} anomal{'y' if len(anomalies) == 1 else 'ies'} detected by mindmon:", ""]
    lines += [f"- {a.message}" for a in anomalies]
    return "\n".join(lines) + "\n"


class EmailRecipient:
    """One e-mail per batch, over SMTP with STARTTLS when the server offers it (SMTPS on 465)."""

    def __init__(self, inform: EmailInform, path: str = "alert.inform"):
        self.inform = inform

    def message(self, anomalies: Sequence[Anomaly]) -> EmailMessage:
        steps = sorted({a.step for a in anomalies})
        ranks = sorted({a.rank for a in anomalies})
        span = f"step {steps[0]}" if len(steps) == 1 else f"steps {steps[0]}-{steps[-1]}"
        message = EmailMessage()
        message["Subject"] = (f"mindmon: {len(anomalies)} anomal{'y' if len(anomalies) == 1 else 'ies'} "
                              f"on rank {','.join(map(str, ranks))}, {span}")
        message["From"] = self.inform.send_email_address
        message["To"] = ", ".join(self.inform.receive_email_address)
        message.set_content(email_body(anomalies))
        return message

    def deliver(self, anomalies: List[Anomaly]) -> None:
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
            smtp.send_message(self.message(anomalies))

    def close(self) -> None:
        pass


def build_recipient(inform, path: str = "alert.inform"):
    return (DatabaseRecipient if isinstance(inform, DatabaseInform) else EmailRecipient)(inform, path)


@dataclass
class DeliveryReport:
    recipient: str
    delivered: int = 0
    failed: int = 0
    dropped: int = 0
    undelivered: int = 0     # still queued or in flight when close gave up
    errors: List[str] = field(default_factory=list)

    @property
    def complete(self) -> bool:
        return not (self.failed or self.dropped or self.undelivered)


class Deliverer:
    """A bounded queue and one daemon thread in front of a recipient.

    Example:
        deliverer = Deliverer(EmailRecipient(inform), logger)
        deliverer.submit(anomalies)   # returns at once
        report = deliverer.close()    # DeliveryReport(delivered=..., failed=..., dropped=...)
    """

    def __init__(self, recipient, logger: logging.Logger):
        self.recipient, self.logger = recipient, logger
        options = recipient.inform.options
        self.close_timeout = options.close_timeout
        self.queue: "queue.Queue[Anomaly]" = queue.Queue(maxsize=options.queue_size)
        self.report = DeliveryReport(recipient.inform.describe())
        self._lock = threading.Lock()
        self._in_flight = 0
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="mindmon-alert-delivery", daemon=True)
        self._thread.start()

    def _masked(self, text: str) -> str:
        return mask_secrets(text, self.recipient.inform.secrets())

    def submit(self, anomalies: Sequence[Anomaly]) -> None:
        """Never blocks: what does not fit in the queue is dropped, counted and logged."""
        for anomaly in anomalies:
            try:
                self.queue.put_nowait(anomaly)
            except queue.Full:
                with self._lock:
                    self.report.dropped += 1
                    first = self.report.dropped == 1
                if first:
                    self.logger.warning("mindmon alerts: the delivery queue to %s is full (%d); anomalies are "
                                        "dropped from delivery (still logged and dumped)",
                                        self.report.recipient, self.queue.maxsize)

    def _next_batch(self) -> List[Anomaly]:
        try:
            batch = [self.queue.get(timeout=0.1)]
        except queue.Empty:
            return []
        while len(batch) < BATCH:
            try:
                batch.append(self.queue.get_nowait())
            except queue.Empty:
                break
        return batch

    def _run(self) -> None:
        while True:
            batch = self._next_batch()
            with self._lock:
                self._in_flight = len(batch)
            if not batch:
                if self._stopping.is_set():
                    return
                continue
            self._deliver(batch)

    def _deliver(self, batch: List[Anomaly]) -> None:
        try:
            self.recipient.deliver(batch)
            outcome = None
        except Exception as error:  # a dead recipient must not end the thread
            outcome = " ".join(self._masked(f"{type(error).__name__}: {error}").split())  # one log line
        with self._lock:
            self._in_flight = 0
            if outcome is None:
                self.report.delivered += len(batch)
            else:
                self.report.failed += len(batch)
                self.report.errors.append(outcome)
        if outcome is not None:
            self.logger.warning("mindmon alerts: delivering %d anomalies to %s failed: %s",
                                len(batch), self.report.recipient, outcome)

    def close(self) -> DeliveryReport:
        """Waits up to close_timeout for the queue to drain, then reports (and logs) the counts."""
        self._stopping.set()
        self._thread.join(self.close_timeout)
        with self._lock:
            if self._thread.is_alive():
                self.report.undelivered = self.queue.qsize() + self._in_flight
        if not self._thread.is_alive():
            self.recipient.close()
        self._log_report()
        return self.report

    def _log_report(self) -> None:
        report = self.report
        text = (f"mindmon alerts: {report.recipient}: {report.delivered} delivered, {report.failed} failed, "
                f"{report.dropped} dropped (queue full), {report.undelivered} not delivered when closing")
        if report.undelivered:
            text += f" (recipient still busy after {self.close_timeout:g} s)"
        (self.logger.info if report.complete else self.logger.error)(text)


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
