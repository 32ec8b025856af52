"""`alert.inform`: the recipients (a database by SQLAlchemy URL, e-mail over SMTP, a webhook over
HTTP(S)), which run events each is told of, and how delivery to them is buffered, retried and
batched. Parsing only; the recipients themselves are in `mindmon.features.alerts.recipients` and
`mindmon.features.alerts.webhook`, the delivery thread in `mindmon.features.alerts.delivery`.

Secrets never enter a message: database URLs are shown through SQLAlchemy's rendering with the
password hidden, the e-mail password and a webhook's signing secret as `***`, a webhook URL as its
scheme and host (chat services put the bot's token in the path or the query).
"""
import hashlib
import json
from dataclasses import dataclass, field
from typing import Any, Dict, Optional, Sequence, Tuple

from mindmon.config import ConfigError, check_keys, is_int, type_error, value_error

MASK = "***"
DEFAULT_TABLE = "mindmon_anomalies"
COMMON_KEYS = ("recipient", "queue_size", "spool_size", "timeout", "close_timeout", "retry_interval",
               "retry_max_interval")
DATABASE_KEYS = COMMON_KEYS + ("events", "connection_str", "table", "batch_size")
EMAIL_KEYS = COMMON_KEYS + ("events", "send_email_address", "receive_email_address", "send_email_username",
                            "send_email_password", "smtp_server", "smtp_port", "email_interval", "email_listed")
WEBHOOK_KEYS = COMMON_KEYS + ("events", "url", "template", "secret", "batch_size", "webhook_interval",
                              "webhook_listed")
RECIPIENTS = ("database", "email", "webhook")
# The run events a recipient can be told of (mindmon.features.alerts.lifecycle), and those it is told
# of when its `events` is absent: the ones that need someone's attention now.
EVENT_KINDS = ("started", "finished", "crashed", "rank_lost", "hang", "slow_rank", "throughput_drop")
DEFAULT_EVENTS = ("crashed", "rank_lost", "hang")
# template -> whether it signs with `secret`; the rest of each template is in mindmon.features.alerts.webhook
WEBHOOK_TEMPLATES = {"generic": False, "slack": False, "feishu": True, "dingtalk": True, "wecom": False}
# Seconds between two posts when `webhook_interval` is absent: a receiving program takes every batch at
# once; a chat group gets at most one digest per interval (and each service limits a bot's rate:
# DingTalk and WeCom 20 messages a minute, Feishu 100 a minute, Slack about one a second).
DEFAULT_WEBHOOK_INTERVAL = {"generic": 0.0, "slack": 10.0, "feishu": 10.0, "dingtalk": 10.0, "wecom": 10.0}


def mask_secrets(text: str, secrets: Sequence[str]) -> str:
    """`text` with every secret (and its URL-quoted forms) replaced by `***`."""
    from urllib.parse import quote, quote_plus

    for secret in secrets:
        if secret:
            for form in sorted({secret, quote(secret, safe=""), quote_plus(secret), quote(secret)}, key=len,
                               reverse=True):
                text = text.replace(form, MASK)
    return text


def _secret_query_key(key: str) -> bool:
    """Query parameters a driver takes a password from (libpq's `?password=`, `sslpassword`, ...)."""
    return "passw" in key.lower() or key.lower() in ("pwd", "secret", "token")


def url_secrets(url: Any) -> Tuple[str, ...]:
    found = [url.password] if url.password else []
    for key, value in url.query.items():
        if _secret_query_key(key):
            found += [value] if isinstance(value, str) else list(value)
    return tuple(found)


def masked_url(url: Any) -> str:
    """The URL as SQLAlchemy renders it with the password (and any password in the query) hidden."""
    query = {key: (MASK if _secret_query_key(key) else value) for key, value in url.query.items()}
    return url.set(query=query).render_as_string(hide_password=True)


def _seconds(path: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf"):
        raise type_error(path, value, "a positive number of seconds")
    return float(value)


def _seconds_or_zero(path: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < float("inf"):
        raise type_error(path, value, "a number of seconds >= 0")
    return float(value)


def _count(path: str, value: Any, minimum: int) -> int:
    if not is_int(value):
        raise type_error(path, value, f"an int >= {minimum}")
    if value < minimum:
        raise value_error(path, value, f"an int >= {minimum}")
    return value


@dataclass(frozen=True)
class DeliveryOptions:
    queue_size: int = 10000        # anomalies held in memory for delivery; more go to the spool
    spool_size: int = 1000000      # anomalies held on disk when memory is full; more are dropped and counted
    timeout: float = 10.0          # seconds for one attempt's connection (SMTP socket, database connect/read)
    close_timeout: float = 30.0    # seconds the end of training goes on retrying
    retry_interval: float = 1.0    # wait after the first failed attempt; doubled after each further one
    retry_max_interval: float = 30.0
    batch_size: int = 500          # database rows per transaction
    email_interval: float = 60.0   # at most one e-mail per interval (a digest of what came meanwhile)
    email_listed: int = 20         # anomalies an e-mail lists in full; the rest are counted by rule and tag
    webhook_interval: Optional[float] = None   # chat templates: at most one post per interval (None: the template's)
    webhook_listed: int = 20       # anomalies a chat message lists in full

    COUNTS = {"queue_size": 1, "spool_size": 0, "batch_size": 1, "email_listed": 1, "webhook_listed": 1}
    SECONDS = ("timeout", "close_timeout", "retry_interval", "retry_max_interval", "email_interval")

    @classmethod
    def parse(cls, path: str, section: Dict[str, Any]) -> "DeliveryOptions":
        out = {key: _count(f"{path}.{key}", section[key], minimum) for key, minimum in cls.COUNTS.items()
               if key in section}
        out.update({key: _seconds(f"{path}.{key}", section[key]) for key in cls.SECONDS if key in section})
        if "webhook_interval" in section:   # 0 is allowed: a receiving program may take every batch at once
            out["webhook_interval"] = _seconds_or_zero(f"{path}.webhook_interval", section["webhook_interval"])
        options = cls(**out)
        if options.retry_max_interval < options.retry_interval:
            raise value_error(f"{path}.retry_max_interval", options.retry_max_interval,
                               f"a number of seconds >= retry_interval ({options.retry_interval:g})")
        return options

    def to_dict(self, keys: Sequence[str]) -> dict:
        return {key: getattr(self, key) for key in keys if hasattr(self, key)}


@dataclass(frozen=True)
class DatabaseInform:
    url: Any = field(repr=False)   # sqlalchemy.engine.URL (holds the password)
    table: str = DEFAULT_TABLE
    options: DeliveryOptions = DeliveryOptions()
    events: Tuple[str, ...] = DEFAULT_EVENTS

    KIND = "database"

    def __repr__(self) -> str:
        return f"DatabaseInform({masked_url(self.url)!r}, table={self.table!r})"

    def describe(self) -> str:
        return f"database {masked_url(self.url)} (table {self.table})"

    def secrets(self) -> Tuple[str, ...]:
        return url_secrets(self.url)

    def to_dict(self) -> dict:
        return {"recipient": "database", "connection_str": masked_url(self.url), "table": self.table,
                "events": list(self.events), **self.options.to_dict(DATABASE_KEYS)}


@dataclass(frozen=True)
class EmailInform:
    send_email_address: str
    receive_email_address: Tuple[str, ...]
    smtp_server: str
    smtp_port: int = 587
    send_email_username: Optional[str] = None
    send_email_password: Optional[str] = field(default=None, repr=False)
    options: DeliveryOptions = DeliveryOptions()
    events: Tuple[str, ...] = DEFAULT_EVENTS

    KIND = "email"

    def describe(self) -> str:
        return f"e-mail to {', '.join(self.receive_email_address)} via {self.smtp_server}:{self.smtp_port}"

    def secrets(self) -> Tuple[str, ...]:
        return (self.send_email_password,) if self.send_email_password else ()

    def to_dict(self) -> dict:
        return {"recipient": "email", "send_email_address": self.send_email_address,
                "receive_email_address": list(self.receive_email_address),
                "send_email_username": self.send_email_username,
                "send_email_password": MASK if self.send_email_password else None,
                "smtp_server": self.smtp_server, "smtp_port": self.smtp_port, "events": list(self.events),
                **self.options.to_dict(EMAIL_KEYS)}


def masked_webhook_url(url: str) -> str:
    """Scheme, host and port only: Slack and Feishu put the bot's token in the path, DingTalk and
    WeCom in the query."""
    from urllib.parse import urlsplit

    parts = urlsplit(url)
    rest = "/***" if (parts.path not in ("", "/") or parts.query) else ""
    return f"{parts.scheme}://{parts.netloc.rpartition('@')[2]}{rest}"


def webhook_url_secrets(url: str) -> Tuple[str, ...]:
    """The parts of a webhook URL that act as its credential: the path, each path segment, each query
    value, any user info."""
    from urllib.parse import parse_qsl, urlsplit

    parts = urlsplit(url)
    found = [url]
    if parts.path not in ("", "/"):
        found.append(parts.path)
        found += [segment for segment in parts.path.split("/") if len(segment) >= 6]
    found += [value for _, value in parse_qsl(parts.query) if len(value) >= 4]
    if "@" in parts.netloc:
        found.append(parts.netloc.rpartition("@")[0])
    return tuple(found)


@dataclass(frozen=True)
class WebhookInform:
    url: str = field(repr=False)         # holds the bot's token
    template: str = "generic"
    secret: Optional[str] = field(default=None, repr=False)
    options: DeliveryOptions = DeliveryOptions()
    events: Tuple[str, ...] = DEFAULT_EVENTS

    KIND = "webhook"

    def __repr__(self) -> str:
        return f"WebhookInform({masked_webhook_url(self.url)!r}, template={self.template!r})"

    @property
    def interval(self) -> float:
        chosen = self.options.webhook_interval
        return DEFAULT_WEBHOOK_INTERVAL[self.template] if chosen is None else chosen

    def describe(self) -> str:
        return f"webhook {masked_webhook_url(self.url)} ({self.template})"

    def secrets(self) -> Tuple[str, ...]:
        return ((self.secret,) if self.secret else ()) + webhook_url_secrets(self.url)

    def to_dict(self) -> dict:
        """`url_id` (a hash of the whole URL) tells two bots on one host apart without showing a token."""
        return {"recipient": "webhook", "url": masked_webhook_url(self.url),
                "url_id": hashlib.sha256(self.url.encode()).hexdigest()[:16], "template": self.template,
                "secret": MASK if self.secret else None, "events": list(self.events),
                "webhook_interval": self.interval, "webhook_listed": self.options.webhook_listed,
                **self.options.to_dict(("queue_size", "spool_size", "timeout", "close_timeout", "retry_interval",
                                        "retry_max_interval", "batch_size"))}


def recipient_id(inform) -> str:
    """A short name for one recipient that stays the same from run to run (its spool's file name):
    the kind and a hash of where it delivers, password excluded."""
    where = {key: value for key, value in inform.to_dict().items() if key not in COMMON_KEYS + (
        "batch_size", "email_interval", "email_listed", "events", "webhook_interval", "webhook_listed")}
    digest = hashlib.sha256(json.dumps(where, sort_keys=True).encode()).hexdigest()[:12]
    return f"{inform.KIND}-{digest}"


def _parse_url(path: str, value: Any):
    try:
        from sqlalchemy.engine import make_url
    except ImportError:
        raise ConfigError(f"{path}: a database recipient needs SQLAlchemy; install mindmon[alerts]") from None
    if not isinstance(value, str) or not value:
        raise ConfigError(f"{path}: got a {type(value).__name__}; allowed: an SQLAlchemy URL string, "
                          f"e.g. postgresql+psycopg2://user:password@host:5432/db or sqlite:///alerts.db")
    allowed = ("allowed: dialect+driver://user:password@host:port/database, special characters in the password "
               "%-escaped (@ as %40)")
    try:
        url = make_url(value)
    except Exception:  # the message would echo the URL, password included
        raise ConfigError(f"{path}: not an SQLAlchemy URL (value not shown: it may hold a password); {allowed}") from None
    if "@" in (url.host or ""):   # an unescaped @ in the password: the rest of it would be shown as the host
        raise ConfigError(f"{path}: more than one @ before the host (value not shown: it may hold a password); "
                          f"{allowed}")
    return url


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
                       options=DeliveryOptions.parse(path, section), **optional, **_events(path, section))


def _events(path: str, section: Dict[str, Any]) -> Dict[str, Tuple[str, ...]]:
    if section.get("events") is None:
        return {}
    value = section["events"]
    if not isinstance(value, list) or not all(isinstance(kind, str) for kind in value):
        raise type_error(f"{path}.events", value, f"a list of run events from {list(EVENT_KINDS)} (may be empty)")
    unknown = [kind for kind in value if kind not in EVENT_KINDS]
    if unknown:
        raise value_error(f"{path}.events", unknown[0], f"run events from {list(EVENT_KINDS)}")
    return {"events": tuple(dict.fromkeys(value))}


def _webhook_url(path: str, value: Any) -> str:
    from urllib.parse import urlsplit

    allowed = "an http:// or https:// URL with a host"
    if not isinstance(value, str) or not value:
        raise type_error(path, value, allowed)
    try:
        parts = urlsplit(value)
        parts.port   # raises on a port that is not a number
    except ValueError:
        raise ConfigError(f"{path}: not a URL (value not shown: it may hold the bot's token); allowed: {allowed}") \
            from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        shown = masked_webhook_url(value) if parts.scheme and parts.hostname else \
            "a URL without a scheme or host (value not shown: it may hold the bot's token)"
        raise ConfigError(f"{path}: got {shown}; allowed: {allowed}")
    return value


def _parse_webhook(path: str, section: Dict[str, Any]) -> WebhookInform:
    if "url" not in section:
        raise ConfigError(f"{path}.url: missing; recipient webhook needs the URL to post to")
    url = _webhook_url(f"{path}.url", section["url"])
    template = section.get("template", "generic")
    if template not in WEBHOOK_TEMPLATES:
        raise value_error(f"{path}.template", template, f"one of {list(WEBHOOK_TEMPLATES)}")
    secret = section.get("secret")
    signing = [name for name, signs in WEBHOOK_TEMPLATES.items() if signs]
    if secret is not None and not WEBHOOK_TEMPLATES[template]:
        raise ConfigError(f"{path}.secret: given for template {template!r}, which does not sign (value not shown); "
                          f"allowed: a secret only with template {' or '.join(signing)}")
    if secret is not None:
        secret = _text(f"{path}.secret", secret, secret=True)
    return WebhookInform(url, template, secret, DeliveryOptions.parse(path, section), **_events(path, section))


def _parse_one(path: str, section: Any):
    if not isinstance(section, dict):
        raise type_error(path, section, 'a mapping with "recipient": "database", "email" or "webhook"')
    recipient = section.get("recipient", "database")  # kj600's default
    if recipient not in RECIPIENTS:
        raise value_error(f"{path}.recipient", recipient, '"database", "email" or "webhook"')
    if recipient == "webhook":
        return _parse_webhook(path, check_keys(path, section, WEBHOOK_KEYS))
    if recipient == "email":
        return _parse_email(path, check_keys(path, section, EMAIL_KEYS))
    section = check_keys(path, section, DATABASE_KEYS)
    if "connection_str" not in section:
        raise ConfigError(f"{path}.connection_str: missing; recipient database needs an SQLAlchemy URL")
    table = section.get("table", DEFAULT_TABLE)
    if not isinstance(table, str) or not table.replace("_", "").isalnum():
        raise value_error(f"{path}.table", table, "a table name of letters, digits and _")
    return DatabaseInform(_parse_url(f"{path}.connection_str", section["connection_str"]), table,
                          DeliveryOptions.parse(path, section), **_events(path, section))


def parse_inform(path: str, value: Any) -> tuple:
    """`inform`: one recipient mapping, a list of them, or None (no delivery)."""
    if value is None:
        return ()
    if isinstance(value, list):
        return tuple(_parse_one(f"{path}[{i}]", item) for i, item in enumerate(value))
    return (_parse_one(path, value),)
