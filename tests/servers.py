"""Real servers for the alert delivery tests: a throwaway PostgreSQL 15 cluster, an in-process
SMTP server (aiosmtpd) with STARTTLS and AUTH, and an SMTP server that accepts and never answers.

PostgreSQL refuses to run as root: under root the cluster belongs to the `postgres` user.
"""
import os
import shutil
import socket
import subprocess
import tempfile
import threading
from dataclasses import dataclass, field
from typing import List

import pytest

PG_USER = "mindmon"
PG_PASSWORD = "pg-s3cr@t/:pw"          # URL-special characters on purpose
SMTP_USER = "alerts@example.org"
SMTP_PASSWORD = "smtp-s3cr3t-pw"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _as_postgres(command: List[str]) -> List[str]:
    return ["runuser", "-u", "postgres", "--"] + command if os.geteuid() == 0 else command


def _run(command: List[str]) -> None:
    """Runs a server command; on failure the test error shows its output, not just the exit code."""
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        pytest.fail(f"{' '.join(command)} failed ({result.returncode}): {result.stdout[-1500:]}{result.stderr[-1500:]}")


def _announce(request, line: str) -> None:
    capture = request.config.pluginmanager.getplugin("capturemanager")
    if capture is None:
        print(line, flush=True)
        return
    with capture.global_and_fixture_disabled():  # shown in the CI log even when output is captured
        print(line, flush=True)


@pytest.fixture(scope="session")
def postgres_url(request):
    """A PostgreSQL cluster on a free 127.0.0.1 port with a password-protected user; its
    SQLAlchemy URL (psycopg2). Stopped and deleted after the session."""
    from sqlalchemy.engine import URL

    if shutil.which("initdb") is None or shutil.which("pg_ctl") is None:
        pytest.fail("PostgreSQL 15 (initdb, pg_ctl on PATH) is needed for the database delivery tests")
    base = tempfile.mkdtemp(prefix="mindmon-pg-")
    data, log, pwfile = (os.path.join(base, name) for name in ("data", "server.log", "pw"))
    with open(pwfile, "w") as f:
        f.write(PG_PASSWORD + "\n")
    if os.geteuid() == 0:
        shutil.chown(base, "postgres", "postgres")
        shutil.chown(pwfile, "postgres", "postgres")
    os.chmod(base, 0o700)
    port = free_port()
    _run(_as_postgres(["initdb", "-D", data, "-U", PG_USER, f"--pwfile={pwfile}", "-E", "UTF8",
                       "--auth-host=scram-sha-256", "--auth-local=trust"]))
    options = f"-p {port} -c listen_addresses=127.0.0.1 -c unix_socket_directories={base} -c fsync=off"
    _run(_as_postgres(["pg_ctl", "-D", data, "-l", log, "-w", "-t", "60", "-o", options, "start"]))
    version = subprocess.run(["postgres", "--version"], capture_output=True, text=True).stdout.strip()
    _announce(request, f"\n[servers] {version} started on 127.0.0.1:{port} (data dir {data})")
    try:
        yield URL.create("postgresql+psycopg2", username=PG_USER, password=PG_PASSWORD, host="127.0.0.1",
                         port=port, database="postgres")
    finally:
        subprocess.run(_as_postgres(["pg_ctl", "-D", data, "-m", "fast", "-w", "stop"]), capture_output=True)
        _announce(request, f"[servers] PostgreSQL on 127.0.0.1:{port} stopped")
        shutil.rmtree(base, ignore_errors=True)


@dataclass
class SmtpInbox:
    """What the in-process SMTP server received."""

    host: str
    port: int
    messages: list = field(default_factory=list)      # email.message.Message objects
    envelopes: list = field(default_factory=list)     # (mail_from, rcpt_tos)
    logins: list = field(default_factory=list)        # (username, password ok?)
    tls_sessions: int = 0
    received: threading.Event = field(default_factory=threading.Event)


def _certificate(folder: str) -> tuple:
    """A self-signed certificate for 127.0.0.1 (the client trusts it through SSL_CERT_FILE)."""
    cert, key = os.path.join(folder, "cert.pem"), os.path.join(folder, "key.pem")
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj",
                    "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1", "-keyout", key, "-out", cert],
                   check=True, capture_output=True)
    return cert, key


class _Handler:
    def __init__(self, inbox: SmtpInbox):
        self.inbox = inbox

    async def handle_DATA(self, server, session, envelope):
        import email

        self.inbox.envelopes.append((envelope.mail_from, list(envelope.rcpt_tos)))
        self.inbox.messages.append(email.message_from_bytes(envelope.content))
        self.inbox.tls_sessions += session.ssl is not None
        self.inbox.received.set()
        return "250 OK"


@pytest.fixture
def smtp_inbox(tmp_path, monkeypatch):
    """An aiosmtpd server on 127.0.0.1 that requires STARTTLS and checks the login."""
    import ssl

    from aiosmtpd.controller import Controller
    from aiosmtpd.smtp import AuthResult

    cert, key = _certificate(str(tmp_path))
    monkeypatch.setenv("SSL_CERT_FILE", cert)   # ssl.create_default_context() trusts it
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(cert, key)
    inbox = SmtpInbox("127.0.0.1", free_port())

    def authenticator(server, session, envelope, mechanism, auth_data):
        ok = auth_data.login == SMTP_USER.encode() and auth_data.password == SMTP_PASSWORD.encode()
        inbox.logins.append((auth_data.login.decode(), ok))
        return AuthResult(success=ok)

    controller = Controller(_Handler(inbox), hostname=inbox.host, port=inbox.port, tls_context=context,
                            require_starttls=True, authenticator=authenticator, auth_required=True)
    controller.start()
    yield inbox
    controller.stop()


class HangingSmtpServer:
    """Accepts connections and never says a word until `release()`: a recipient that hangs."""

    def __init__(self):
        self.port = free_port()
        self.accepted = threading.Event()
        self.released = threading.Event()
        self._socket = socket.create_server(("127.0.0.1", self.port))
        self._socket.settimeout(0.2)
        self._connections = []
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self):
        while not self.released.is_set():
            try:
                connection, _ = self._socket.accept()
            except socket.timeout:
                continue
            except OSError:
                return
            self._connections.append(connection)
            self.accepted.set()

    def release(self):
        self.released.set()
        for connection in self._connections:
            connection.close()
        self._socket.close()


@pytest.fixture
def hanging_smtp():
    server = HangingSmtpServer()
    yield server
    server.release()
