"""The webhook recipient: one HTTP(S) POST per batch, through the same buffer, spool and retries as
the database and e-mail (mindmon.features.alerts.delivery). Templates:

- `generic`: a JSON object for a program: every anomaly and event with its idempotency `key`, so
  the receiver drops one it already has (a batch is sent again when its answer is lost); the
  batch's own hash in the `Idempotency-Key` header. Any 2xx answer is success.
- `slack`: an incoming webhook, `{"text": ...}`; success is HTTP 200.
- `feishu`: a Feishu/Lark custom bot, `{"msg_type": "text", "content": {"text": ...}}`, with
  `timestamp` (seconds) and `sign` in the body when a secret is set; success is `"code": 0`.
- `dingtalk`: a DingTalk custom robot, `{"msgtype": "text", "text": {"content": ...}}`, with
  `timestamp` (milliseconds) and `sign` in the URL's query when a secret is set; success is
  `"errcode": 0`.
- `wecom`: a WeCom group robot, `{"msgtype": "text", "text": {"content": ...}}`; success is
  `"errcode": 0`.

The chat templates send a digest (mindmon.features.alerts.render), cut to the service's size limit.
Feishu, DingTalk and WeCom answer HTTP 200 to a refused message too; their JSON `code`/`errcode`
tells, and a non-zero one is a failed attempt (retried).

Example:
    recipient = WebhookRecipient(WebhookInform("https://oapi.dingtalk.com/robot/send?access_token=...",
                                               "dingtalk", secret="SEC..."))
    recipient.deliver(items)    # raises WebhookRefused (or a socket error) on failure
"""
import base64
import hashlib
import hmac
import json
import time
import urllib.error
import urllib.request
from typing import Optional, Sequence, Tuple
from urllib.parse import quote_plus

from mindmon.features.alerts.anomaly import KeyedAnomaly
from mindmon.features.alerts.inform import WebhookInform
from mindmon.features.alerts.render import body, fit, title

# A chat message's text limit in UTF-8 bytes, below each service's documented limit (WeCom text
# 2048 bytes; DingTalk and Feishu about 20,000 bytes of request; Slack cuts text past 40,000 characters).
TEXT_LIMIT = {"slack": 38000, "feishu": 18000, "dingtalk": 18000, "wecom": 2000}
ANSWER_SHOWN = 300   # characters of a refusing answer kept for the log


class WebhookRefused(Exception):
    """An answer that is not success; `cause` is its short name in the delivery report."""

    def __init__(self, cause: str, detail: str):
        super().__init__(f"{cause}: {detail}")
        self.cause = cause


def feishu_sign(secret: str, timestamp: int) -> str:
    """Feishu/Lark: base64 of HMAC-SHA256 keyed with "<timestamp>\\n<secret>" over an empty message."""
    key = f"{timestamp}\n{secret}".encode()
    return base64.b64encode(hmac.new(key, b"", hashlib.sha256).digest()).decode()


def dingtalk_sign(secret: str, timestamp_ms: int) -> str:
    """DingTalk: base64 of HMAC-SHA256 keyed with the secret over "<timestamp>\\n<secret>" (not yet URL-escaped)."""
    message = f"{timestamp_ms}\n{secret}".encode()
    return base64.b64encode(hmac.new(secret.encode(), message, hashlib.sha256).digest()).decode()


def batch_id(items: Sequence[KeyedAnomaly]) -> str:
    return hashlib.sha256("".join(item.key for item in items).encode()).hexdigest()[:32]


def generic_body(items: Sequence[KeyedAnomaly]) -> dict:
    entries = [{"key": item.key, "run_id": item.run_id, "type": "event" if item.anomaly.is_event else "anomaly",
                **item.anomaly.to_json()} for item in items]
    return {"source": "mindmon", "batch": batch_id(items), "title": title(items), "count": len(entries),
            "items": entries}


def slack_escape(text: str) -> str:
    """Slack reads &, < and > as markup: its message formatting asks for them as entities."""
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def chat_text(template: str, items: Sequence[KeyedAnomaly], listed: int) -> str:
    text = fit(f"{title(items)}\n\n{body(items, listed)}", TEXT_LIMIT[template])
    return slack_escape(text) if template == "slack" else text


def request_of(inform: WebhookInform, items: Sequence[KeyedAnomaly], now: Optional[float] = None) -> Tuple[str, dict]:
    """(the URL to post to, the JSON body) for one batch; `now` in seconds since the epoch (the signature's time)."""
    now = time.time() if now is None else now
    template, url = inform.template, inform.url
    if template == "generic":
        return url, generic_body(items)
    text = chat_text(template, items, inform.options.webhook_listed)
    if template == "slack":
        return url, {"text": text}
    if template == "feishu":
        payload = {"msg_type": "text", "content": {"text": text}}
        if inform.secret:
            seconds = int(now)
            payload = {"timestamp": str(seconds), "sign": feishu_sign(inform.secret, seconds), **payload}
        return url, payload
    if inform.secret:   # dingtalk
        milliseconds = int(now * 1000)
        sign = quote_plus(dingtalk_sign(inform.secret, milliseconds))
        url = f"{url}{'&' if '?' in url else '?'}timestamp={milliseconds}&sign={sign}"
    return url, {"msgtype": "text", "text": {"content": text}}


def _check_answer(template: str, status: int, answer: str) -> None:
    shown = " ".join(answer[:ANSWER_SHOWN].split())
    if not 200 <= status < 300:
        raise WebhookRefused("rate limited (HTTP 429)" if status == 429 else f"HTTP {status}", shown)
    if template in ("generic", "slack"):
        return
    try:
        reply = json.loads(answer)
    except ValueError:
        raise WebhookRefused("answer not JSON", shown) from None
    field = "code" if template == "feishu" else "errcode"
    code = reply.get(field, reply.get("StatusCode")) if isinstance(reply, dict) else None
    if code != 0:
        raise WebhookRefused(f"refused ({field} {code})", shown)


class WebhookRecipient:
    """One POST per batch: `generic` takes up to `batch_size` items a post, at most one post per
    `webhook_interval` (default 0); a chat template takes everything waiting as one digest, at
    most one per `webhook_interval` (default 10 s)."""

    def __init__(self, inform: WebhookInform, path: str = "alert.inform"):
        self.inform = inform
        self.min_interval = inform.interval
        generic = inform.template == "generic"
        self.batch_limit = inform.options.batch_size if generic else 100000
        if not generic:
            self.listed = inform.options.webhook_listed   # the delivery report counts what a digest folds

    def deliver(self, items: Sequence[KeyedAnomaly]) -> None:
        url, payload = request_of(self.inform, items)
        data = json.dumps(payload, ensure_ascii=False, allow_nan=False).encode()
        headers = {"Content-Type": "application/json; charset=utf-8", "User-Agent": "mindmon-alerts"}
        if self.inform.template == "generic":
            headers["Idempotency-Key"] = batch_id(items)
        request = urllib.request.Request(url, data=data, headers=headers, method="POST")
        try:
            with urllib.request.urlopen(request, timeout=self.inform.options.timeout) as answer:
                status, text = answer.status, answer.read().decode("utf-8", "replace")
        except urllib.error.HTTPError as error:   # a non-2xx answer: its body says why
            status, text = error.code, error.read().decode("utf-8", "replace")
            error.close()
        _check_answer(self.inform.template, status, text)

    def close(self) -> None:
        pass
