"""Delivering anomalies to one recipient off the training thread, through outages.

`submit` (the training thread) only puts anomalies in the recipient's `DeliveryBuffer` (memory,
then the on-disk spool; never a network call). One daemon thread sends the oldest batch; a batch
that fails stays at the front and is tried again after a wait that doubles from `retry_interval`
up to `retry_max_interval`, so after an outage delivery resumes in order. `close` goes on trying
for at most `close_timeout` seconds, then leaves what is undelivered in the spool file and reports
it by cause. Every message it logs has the recipient's password replaced by `***`.
"""
import logging
import smtplib
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence

from mindmon.features.alerts.anomaly import Anomaly, KeyedAnomaly
from mindmon.features.alerts.buffer import DeliveryBuffer, Spool
from mindmon.features.alerts.inform import mask_secrets

MAX_ERRORS_KEPT = 20


def failure_cause(error: BaseException) -> str:
    """A short name for why an attempt failed, the same for every driver where it can be told."""
    named = getattr(error, "cause", None)   # a webhook's refusal names itself (`HTTP 500`, `refused (errcode 310000)`)
    if isinstance(named, str):
        return named
    text = str(error).lower()
    if isinstance(error, (socket.timeout, TimeoutError)) or "timed out" in text or "timeout expired" in text:
        return "timeout"
    if isinstance(error, smtplib.SMTPAuthenticationError) or "authentication failed" in text \
            or "access denied" in text:
        return "authentication failed"
    if isinstance(error, ConnectionRefusedError) or "connection refused" in text:
        return "connection refused"
    if "database is locked" in text:
        return "database locked"
    if any(part in text for part in ("shutting down", "starting up", "administrator command", "server closed",
                                     "lost connection", "gone away", "connection reset", "unexpectedly closed")) \
            or isinstance(error, (smtplib.SMTPServerDisconnected, ConnectionError)):
        return "connection lost"
    return type(error).__name__


@dataclass
class DeliveryReport:
    recipient: str
    delivered: int = 0
    failed_attempts: int = 0                                   # attempts that failed (and were retried)
    undelivered: Dict[str, int] = field(default_factory=dict)  # cause -> anomalies not delivered in the end
    spooled: int = 0                                           # of those, in the spool file at the end
    spool_path: Optional[str] = None
    folded: int = 0                                            # e-mail: counted in a digest, not listed
    errors: List[str] = field(default_factory=list)            # distinct failure messages, masked

    @property
    def lost(self) -> int:
        return sum(self.undelivered.values())

    @property
    def complete(self) -> bool:
        return not self.undelivered

    def count(self, cause: str, n: int) -> None:
        if n:
            self.undelivered[cause] = self.undelivered.get(cause, 0) + n

    def summary(self) -> str:
        text = f"{self.recipient}: {self.delivered} delivered, {self.failed_attempts} failed attempts"
        if self.undelivered:
            causes = ", ".join(f"{cause}: {n}" for cause, n in sorted(self.undelivered.items()))
            text += f", {self.lost} undelivered ({causes})"
        if self.spooled:
            text += f", {self.spooled} left in {self.spool_path} (`mindmon alerts resend` delivers them)"
        return text


class Deliverer:
    """One recipient's buffer and delivery thread.

    Example:
        deliverer = Deliverer(EmailRecipient(inform), logger, spool_path, run_id)
        deliverer.submit(anomalies)   # returns at once
        report = deliverer.close()    # DeliveryReport(delivered=..., undelivered={cause: n}, ...)
    """

    def __init__(self, recipient, logger: logging.Logger, spool_path: Optional[str] = None, run_id: str = ""):
        self.recipient, self.logger, self.run_id = recipient, logger, run_id
        self.options = recipient.inform.options
        spool = self._open_spool(spool_path)
        self.buffer = DeliveryBuffer(self.options.queue_size, spool)
        self.report = DeliveryReport(recipient.inform.describe(), spool_path=spool_path)
        self._lock = threading.Lock()
        self._logged = set()              # what was logged once already
        self._last_cause: Optional[str] = None
        self._outage_started: Optional[float] = None
        self._deadline: Optional[float] = None
        self._closing = threading.Event()
        self._thread = threading.Thread(target=self._run, name="mindmon-alert-delivery", daemon=True)
        self._thread.start()

    def _open_spool(self, path: Optional[str]) -> Optional[Spool]:
        if path is None or self.options.spool_size == 0:
            return None
        try:
            spool = Spool(path, self.options.spool_size, self.recipient.inform.to_dict())
        except OSError as error:   # an unreadable spool from an earlier run: memory only, said once
            self.logger.error("mindmon alerts: the spool %s cannot be read (%s); delivery to %s keeps at most "
                              "%d anomalies in memory", path, error, self.recipient.inform.describe(),
                              self.options.queue_size)
            return None
        if spool.unread:
            self.logger.info("mindmon alerts: %d anomalies an earlier run left in %s are delivered first",
                             spool.unread, path)
        return spool

    def _masked(self, text: str) -> str:
        return " ".join(mask_secrets(text, self.recipient.inform.secrets()).split())  # one log line

    def _once(self, key: str, level: int, message: str, *args) -> None:
        if key not in self._logged:
            self._logged.add(key)
            self.logger.log(level, message, *args)

    def wants(self, anomaly: Anomaly) -> bool:
        """Every anomaly; a run event when the recipient's `events` names its kind."""
        return not anomaly.is_event or anomaly.kind in self.recipient.inform.events

    def submit(self, anomalies: Sequence[Anomaly]) -> None:
        """Never waits for the network: what fits neither in memory nor in the spool is dropped,
        counted and logged once (it is still logged and dumped)."""
        spilled_before = self.buffer.spilled
        dropped, error = self.buffer.put([KeyedAnomaly.of(self.run_id, a) for a in anomalies])
        if self.buffer.spilled > spilled_before:
            self._once("spill", logging.WARNING, "mindmon alerts: %d anomalies wait for %s, more than queue_size; "
                       "the rest go to %s", self.options.queue_size, self.report.recipient, self.report.spool_path)
        if dropped:
            cause = f"spool write failed ({error.strerror or error})" if error else "buffer full"
            with self._lock:
                self.report.count(cause, dropped)
            self._once(cause, logging.ERROR, "mindmon alerts: %s: %s; anomalies are dropped from delivery (still "
                       "logged and dumped), training goes on", self.report.recipient, cause)

    def _run(self) -> None:
        delay, next_send = self.options.retry_interval, 0.0
        while not self._past_deadline():
            batch = self.buffer.take(self.recipient.batch_limit)
            if not batch:
                if self._closing.is_set():
                    return
                self.buffer.arrived.wait(0.2)
                continue
            if not self._closing.is_set() and time.monotonic() < next_send:   # e-mail: one digest per interval
                self._closing.wait(next_send - time.monotonic())
                continue
            if self._attempt(batch):
                delay, next_send = self.options.retry_interval, time.monotonic() + self.recipient.min_interval
            else:
                self._pause(delay)
                delay = min(2 * delay, self.options.retry_max_interval)

    def _past_deadline(self) -> bool:
        return self._deadline is not None and time.monotonic() >= self._deadline

    def _pause(self, seconds: float) -> None:
        if self._closing.is_set():
            time.sleep(max(0.0, min(seconds, self._deadline - time.monotonic())))
        else:
            self._closing.wait(seconds)   # cut short by close: try once more right away

    def _attempt(self, batch: List[KeyedAnomaly]) -> bool:
        try:
            self.recipient.deliver(batch)
        except Exception as error:  # a dead recipient must not end the thread
            self._failed(len(batch), error)
            return False
        self.buffer.done(len(batch))
        anomalies = sum(1 for item in batch if not item.anomaly.is_event)   # events are always in full
        with self._lock:
            self.report.delivered += len(batch)
            self.report.folded += max(0, anomalies - getattr(self.recipient, "listed", anomalies))
        if self._outage_started is not None:
            self.logger.warning("mindmon alerts: delivery to %s works again after %.1f s; %d anomalies still wait",
                                self.report.recipient, time.monotonic() - self._outage_started, len(self.buffer))
            self._outage_started = None
        self._last_cause = None
        self._note_digest(anomalies)
        return True

    def _note_digest(self, n: int) -> None:
        listed = getattr(self.recipient, "listed", None)
        if listed is not None and n > listed:
            self.logger.info("mindmon alerts: %s: one message carries %d anomalies: %d listed in full, %d folded "
                             "into counts by rule and tag", self.report.recipient, n, listed, n - listed)

    def _failed(self, n: int, error: Exception) -> None:
        message = self._masked(f"{type(error).__name__}: {error}")
        cause = failure_cause(error)
        with self._lock:
            self.report.failed_attempts += 1
            if message not in self.report.errors and len(self.report.errors) < MAX_ERRORS_KEPT:
                self.report.errors.append(message)
        if self._outage_started is None:
            self._outage_started = time.monotonic()
        if cause != self._last_cause:   # once per outage and cause, not once per retry
            self.logger.warning("mindmon alerts: delivering %d anomalies to %s failed (%s): %s; retrying with "
                                "backoff up to %g s, nothing is dropped while the buffer has room", n,
                                self.report.recipient, cause, message, self.options.retry_max_interval)
        self._last_cause = cause

    def start_closing(self) -> None:
        """From now on, at most close_timeout seconds more of delivery (several recipients in parallel)."""
        if self._deadline is None:
            self._deadline = time.monotonic() + self.options.close_timeout
            self._closing.set()
            self.buffer.arrived.set()

    def close(self) -> DeliveryReport:
        """Goes on delivering for at most close_timeout seconds, then leaves what is left in the
        spool file, logs one line of counts (an error line when anything was not delivered)."""
        self.start_closing()
        self._thread.join(max(0.0, self._deadline - time.monotonic()) + 0.5)
        left, error = self.buffer.finish()
        with self._lock:
            report = self.report
            if left:
                cause = self._last_cause or "close_timeout ran out"
                report.count(cause if error is None else f"{cause}; spool write failed ({error.strerror})", left)
                report.spooled = 0 if error is not None or self.buffer.spool is None else left
        if not self._thread.is_alive():
            self.recipient.close()
        (self.logger.info if report.complete else self.logger.error)("mindmon alerts: %s", report.summary())
        return report
