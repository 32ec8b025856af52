"""Real servers for the alert delivery tests: a throwaway PostgreSQL 15 cluster, a throwaway MariaDB
server (the distribution's mariadb-server, MySQL's protocol, kj600's default database), an in-process
SMTP server (aiosmtpd) with STARTTLS and AUTH, and an SMTP server that accepts and never answers.

PostgreSQL refuses to run as root: under root the cluster belongs to the `postgres` user.
"""
import glob
import os
import shutil
import socket
import subprocess
import tempfile
import threading
import time
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


def _postgres_tool(name: str) -> str:
    """A PostgreSQL server program: on PATH, else in the newest of Debian's versioned folders, which
    its postgresql package leaves off PATH."""
    folders = sorted(glob.glob("/usr/lib/postgresql/*/bin"), key=lambda f: int(f.split("/")[-2]))
    found = shutil.which(name) or shutil.which(name, path=os.pathsep.join(reversed(folders)))
    if found is None:
        pytest.fail(f"PostgreSQL 15's {name} (on PATH or in /usr/lib/postgresql/*/bin) is needed for the database "
                    "delivery tests: apt-get install -y postgresql (make test does it under root)")
    return found


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


class PostgresServer:
    """A PostgreSQL cluster on a free 127.0.0.1 port with a password-protected user, which a test
    may stop and start again (the same data, the same port)."""

    def __init__(self, base: str):
        self.base = base
        self.data, self.log, pwfile = (os.path.join(base, name) for name in ("data", "server.log", "pw"))
        with open(pwfile, "w") as f:
            f.write(PG_PASSWORD + "\n")
        if os.geteuid() == 0:
            shutil.chown(base, "postgres", "postgres")
            shutil.chown(pwfile, "postgres", "postgres")
        os.chmod(base, 0o700)
        self.port = free_port()
        _run(_as_postgres([_postgres_tool("initdb"), "-D", self.data, "-U", PG_USER, f"--pwfile={pwfile}", "-E",
                           "UTF8", "--auth-host=scram-sha-256", "--auth-local=trust"]))

    def start(self) -> None:
        options = f"-p {self.port} -c listen_addresses=127.0.0.1 -c unix_socket_directories={self.base} -c fsync=off"
        _run(_as_postgres([_postgres_tool("pg_ctl"), "-D", self.data, "-l", self.log, "-w", "-t", "60", "-o", options,
                           "start"]))

    def stop(self) -> None:
        _run(_as_postgres([_postgres_tool("pg_ctl"), "-D", self.data, "-m", "fast", "-w", "stop"]))

    @property
    def url(self):
        from sqlalchemy.engine import URL

        return URL.create("postgresql+psycopg2", username=PG_USER, password=PG_PASSWORD, host="127.0.0.1",
                          port=self.port, database="postgres")


@pytest.fixture(scope="session")
def postgres_server(request):
    """The session's PostgreSQL server (stopped and deleted after the session)."""
    for tool in ("initdb", "pg_ctl"):   # a missing one fails the test before anything is made
        _postgres_tool(tool)
    server = PostgresServer(tempfile.mkdtemp(prefix="mindmon-pg-"))
    server.start()
    version = subprocess.run([_postgres_tool("postgres"), "--version"], capture_output=True, text=True).stdout.strip()
    _announce(request, f"\n[servers] {version} started on 127.0.0.1:{server.port} (data dir {server.data})")
    try:
        yield server
    finally:
        subprocess.run(_as_postgres([_postgres_tool("pg_ctl"), "-D", server.data, "-m", "fast", "-w", "stop"]),
                   capture_output=True)
        _announce(request, f"[servers] PostgreSQL on 127.0.0.1:{server.port} stopped")
        shutil.rmtree(server.base, ignore_errors=True)


@pytest.fixture(scope="session")
def postgres_url(postgres_server):
    """The SQLAlchemy URL (psycopg2) of the session's PostgreSQL server."""
    return postgres_server.url


MYSQL_USER = "kj600"
MYSQL_PASSWORD = "my-s3cr@t:pw/x"     # URL-special characters on purpose
MYSQL_DATABASE = "alerts"


def _mariadbd() -> str:
    for name in ("mariadbd", "mysqld"):
        found = shutil.which(name) or shutil.which(name, path="/usr/sbin:/usr/local/sbin")
        if found:
            return found
    pytest.fail("MariaDB (mariadbd, from the distribution's mariadb-server package) is needed for the MySQL "
                "delivery tests: apt-get install -y mariadb-server (make test does it under root)")


class MariaDBServer:
    """A throwaway MariaDB server (the distribution's mariadbd) on a free 127.0.0.1 port, its
    database and password-protected user made by an init file at every start. Under root the data
    belongs to the `mysql` user. A test may stop it and start it again."""

    def __init__(self, base: str):
        self.base, self.binary = base, _mariadbd()
        self.data, self.log = os.path.join(base, "data"), os.path.join(base, "server.log")
        self.socket, self.init = os.path.join(base, "mysqld.sock"), os.path.join(base, "init.sql")
        self.port, self.process = free_port(), None
        with open(self.init, "w") as f:
            password = MYSQL_PASSWORD.replace("'", "''")
            f.write(f"CREATE DATABASE IF NOT EXISTS {MYSQL_DATABASE};\n"
                    f"CREATE USER IF NOT EXISTS '{MYSQL_USER}'@'127.0.0.1' IDENTIFIED BY '{password}';\n"
                    f"GRANT ALL ON {MYSQL_DATABASE}.* TO '{MYSQL_USER}'@'127.0.0.1';\n")
        user = ["--user=mysql"] if os.geteuid() == 0 else []
        if os.geteuid() == 0:
            shutil.chown(base, "mysql", "mysql")
        install = shutil.which("mariadb-install-db") or shutil.which("mysql_install_db")
        _run([install, "--no-defaults", f"--datadir={self.data}", "--auth-root-authentication-method=socket",
              "--skip-test-db"] + user)

    def start(self, timeout: float = 60) -> None:
        import time

        user = ["--user=mysql"] if os.geteuid() == 0 else []
        self.process = subprocess.Popen(
            [self.binary, "--no-defaults", f"--datadir={self.data}", f"--port={self.port}", "--bind-address=127.0.0.1",
             f"--socket={self.socket}", f"--init-file={self.init}", f"--log-error={self.log}",
             f"--pid-file={os.path.join(self.base, 'mysqld.pid')}", "--skip-log-bin", "--innodb-buffer-pool-size=32M",
             "--innodb-flush-log-at-trx-commit=0"] + user, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                pytest.fail(f"mariadbd exited ({self.process.returncode}): {open(self.log).read()[-1500:]}")
            if self._accepts_login():
                return
            time.sleep(0.2)
        pytest.fail(f"mariadbd did not accept a login within {timeout} s: {open(self.log).read()[-1500:]}")

    def _accepts_login(self) -> bool:
        import pymysql

        try:
            pymysql.connect(host="127.0.0.1", port=self.port, user=MYSQL_USER, password=MYSQL_PASSWORD,
                            database=MYSQL_DATABASE, connect_timeout=2).close()
            return True
        except pymysql.err.MySQLError:
            return False

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            self.process.wait(60)
        self.process = None

    @property
    def url(self):
        from sqlalchemy.engine import URL

        return URL.create("mysql+pymysql", username=MYSQL_USER, password=MYSQL_PASSWORD, host="127.0.0.1",
                          port=self.port, database=MYSQL_DATABASE)


@pytest.fixture(scope="session")
def mariadb_server(request):
    """The session's MariaDB server (stopped and deleted after the session)."""
    server = MariaDBServer(tempfile.mkdtemp(prefix="mindmon-mariadb-"))
    server.start()
    version = subprocess.run([server.binary, "--version"], capture_output=True, text=True).stdout.strip()
    _announce(request, f"\n[servers] {version} started on 127.0.0.1:{server.port} (data dir {server.data})")
    try:
        yield server
    finally:
        server.stop()
        _announce(request, f"[servers] MariaDB on 127.0.0.1:{server.port} stopped")
        shutil.rmtree(server.base, ignore_errors=True)


@dataclass
class SmtpInbox:
    """What the in-process SMTP server received."""

    host: str
    port: int
    messages: list = field(default_factory=list)      # email.message.Message objects
    envelopes: list = field(default_factory=list)     # (mail_from, rcpt_tos)
    logins: list = field(default_factory=list)        # (username, password ok?)
    arrival_times: list = field(default_factory=list)  # time.monotonic() of each message
    tls_sessions: int = 0
    received: threading.Event = field(default_factory=threading.Event)
    make_controller: object = None                    # builds the server on `port`
    controller: object = None

    def start(self) -> None:
        self.controller = self.make_controller()
        self.controller.start()

    def stop(self) -> None:
        """The server goes away (its port refuses connections) until `start`."""
        self.controller.stop()


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
        self.inbox.arrival_times.append(time.monotonic())
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
        if ok:
            return AuthResult(success=True)
        # a server that echoes what it got in its refusal, as some do: the client must not pass it on
        return AuthResult(success=False, handled=False, message=f"535 5.7.8 login {auth_data.login.decode()} with "
                                                                f"password {auth_data.password.decode()} refused")

    inbox.make_controller = lambda: Controller(_Handler(inbox), hostname=inbox.host, port=inbox.port,
                                               tls_context=context, require_starttls=True,
                                               authenticator=authenticator, auth_required=True)
    inbox.start()
    yield inbox
    inbox.stop()


class HangingSmtpServer:
    """Accepts connections and never says a word until `release()`: a recipient that hangs (an
    SMTP server, or a database: neither protocol gets its greeting)."""

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
