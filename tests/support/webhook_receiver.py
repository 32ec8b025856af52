"""A webhook receiver of the tests' own: http.server on a thread, recording every POST (path, query,
headers, JSON body) and answering as each service documents its success (Slack `ok`, Feishu
`{"code": 0}`, DingTalk and WeCom `{"errcode": 0}`, any other path 200 `{}`). A test can script
failures (`fail_next(n, status)`, `stall_next(n, seconds)`: the request is recorded, then the answer
withheld past the sender's timeout) and take the server down and up again on the same port.
"""
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlsplit

SUCCESS = {"/slack": (200, "ok"), "/feishu": (200, '{"code":0,"msg":"success","data":{}}'),
           "/dingtalk": (200, '{"errcode":0,"errmsg":"ok"}'), "/wecom": (200, '{"errcode":0,"errmsg":"ok"}')}


class Receiver:
    def __init__(self, port: int = 0):
        self.requests = []            # dicts: path, query, headers, body, arrived
        self.lock = threading.Lock()
        self.failures = []            # scripted answers for the next requests: ("status", code) or ("stall", s)
        self.answer = {}              # path -> (status, text) replacing SUCCESS
        self.server = None
        self.port = port
        self.start()

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                receiver.handle(self)

            def log_message(self, *args):
                pass

        ThreadingHTTPServer.allow_reuse_address = True
        self.server = ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def fail_next(self, n: int, status: int = 500) -> None:
        with self.lock:
            self.failures += [("status", status)] * n

    def stall_next(self, n: int, seconds: float) -> None:
        with self.lock:
            self.failures += [("stall", seconds)] * n

    def handle(self, handler) -> None:
        length = int(handler.headers.get("Content-Length", 0))
        raw = handler.rfile.read(length)
        parts = urlsplit(handler.path)
        with self.lock:
            scripted = self.failures.pop(0) if self.failures else None
            if scripted is None or scripted[0] == "stall":   # a refused request is not received
                self.requests.append({"path": parts.path, "query": parse_qs(parts.query), "raw_path": handler.path,
                                      "headers": dict(handler.headers), "body": json.loads(raw.decode()),
                                      "raw": raw, "arrived": time.time()})
        if scripted is not None and scripted[0] == "stall":
            time.sleep(scripted[1])
        service = "/" + parts.path.split("/")[1]   # /feishu/<token> answers as /feishu
        status, text = (scripted[1], "scripted failure") if scripted and scripted[0] == "status" else \
            self.answer.get(parts.path, SUCCESS.get(service, (200, "{}")))
        data = text.encode()
        try:
            handler.send_response(status)
            handler.send_header("Content-Type", "application/json" if text.startswith("{") else "text/plain")
            handler.send_header("Content-Length", str(len(data)))
            handler.end_headers()
            handler.wfile.write(data)
        except OSError:   # the sender gave up on a stalled answer
            pass

    def of(self, path: str):
        """The requests to `path` or below it, in arrival order."""
        with self.lock:
            return [r for r in self.requests if r["path"] == path or r["path"].startswith(path + "/")]

    def bodies(self, path: str):
        return [r["body"] for r in self.of(path)]
