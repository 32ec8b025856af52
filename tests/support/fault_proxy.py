"""A TCP proxy between a database client and a real server that loses the answer to a COMMIT: it
forwards the client's COMMIT, reads the server's answer (so the commit has happened on the
server), and closes both connections without passing the answer on. Plain sockets and threads.

Example:
    proxy = LostCommitProxy(server_port, POSTGRES_COMMIT, lose=2)   # the first two COMMITs after an INSERT
    url = url.set(port=proxy.port)
    ...
    proxy.lost_answers   # the answers the client never got, as the server sent them
"""
import select
import socket
import threading
from typing import List

# the COMMIT each driver sends: PostgreSQL's simple Query message ('Q', length 11, "COMMIT\0");
# MySQL's COM_QUERY packet (3-byte length 7, sequence 0, command 3, "COMMIT")
POSTGRES_COMMIT = b"Q\x00\x00\x00\x0bCOMMIT\x00"
MYSQL_COMMIT = b"\x07\x00\x00\x00\x03COMMIT"
INSERT = b"INSERT INTO"


class LostCommitProxy:
    def __init__(self, server_port: int, commit: bytes, lose: int):
        self.server_port, self.commit, self.to_lose = server_port, commit, lose
        self.lost_answers: List[bytes] = []
        self.connections = 0
        self._lock = threading.Lock()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            server = socket.create_connection(("127.0.0.1", self.server_port))
            self.connections += 1
            threading.Thread(target=self._relay, args=(client, server), daemon=True).start()

    def _should_cut(self, data: bytes, inserted: bool) -> bool:
        """A COMMIT closing a transaction that inserted, while answers are still to be lost."""
        if not (inserted and self.commit in data):
            return False
        with self._lock:
            if self.to_lose <= 0:
                return False
            self.to_lose -= 1
            return True

    def _relay(self, client, server) -> None:
        """One thread per connection, both directions: the answer to a cut COMMIT is read here, so
        nothing else can pass it on."""
        inserted = False
        try:
            while True:
                ready, _, _ = select.select([client, server], [], [])
                if server in ready:
                    data = server.recv(65536)
                    if not data:
                        return
                    client.sendall(data)
                if client in ready:
                    data = client.recv(65536)
                    if not data:
                        return
                    inserted |= INSERT in data
                    server.sendall(data)
                    if self._should_cut(data, inserted):
                        self._swallow_answer(server)
                        return
                    if self.commit in data:
                        inserted = False
        except OSError:
            pass
        finally:
            for end in (client, server):
                _close(end)

    def _swallow_answer(self, server) -> None:
        """Waits for the server's answer to the COMMIT (the commit is then done) and keeps it."""
        server.settimeout(10)
        try:
            answer = server.recv(65536)
        except OSError:
            answer = b""
        with self._lock:
            self.lost_answers.append(answer)

    def close(self) -> None:
        _close(self._listener)


def _close(end) -> None:
    try:
        end.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    end.close()
