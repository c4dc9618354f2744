"""Hugging Face Hubs on 127.0.0.1 only, for the tests of what llmctl does online (HF_HUB_OFFLINE
unset) on a machine without network: one that cannot be reached (conftest's `dead_hub`), and one
that answers every request "not found" as the Hub does (NotFoundHub)."""


class DeadHub:
    """An HF_ENDPOINT on 127.0.0.1 that cannot serve: "refused" is a port that was bound and
    closed again (what a machine without network gives a connection), "reset" accepts each
    connection, records its request line and closes it unanswered, so the test can count the
    requests huggingface_hub makes."""

    def __init__(self, kind):
        import socket
        import threading

        self.kind = kind
        self.requests = []
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        if kind == "refused":
            self.sock.close()
            return
        self.sock.listen(16)

        def serve():
            while True:
                try:
                    conn, _ = self.sock.accept()
                except OSError:
                    return
                conn.settimeout(5)
                try:
                    self.requests.append(conn.recv(4096).split(b"\r\n")[0].decode(errors="replace"))
                except OSError:
                    pass
                conn.close()

        threading.Thread(target=serve, daemon=True).start()

    def heads(self):
        return [r for r in self.requests if r.startswith("HEAD ")]


class NotFoundHub:
    """An HF_ENDPOINT on 127.0.0.1 that answers every request 404 with the Hub's X-Error-Code
    header ("RepoNotFound", "RevisionNotFound" or "EntryNotFound"), from which huggingface_hub's
    own hf_raise_for_status picks its exception; records the request lines."""

    def __init__(self, code):
        import http.server
        import threading

        hub = self
        self.code, self.requests = code, []

        class Handler(http.server.BaseHTTPRequestHandler):
            def _answer(self):
                hub.requests.append(self.requestline)
                self.send_response(404)
                self.send_header("X-Error-Code", hub.code)
                self.send_header("X-Error-Message", f"{hub.code} (127.0.0.1 test hub)")
                self.send_header("Content-Length", "0")
                self.end_headers()

            do_HEAD = do_GET = _answer

            def log_message(self, *args):
                pass

        self.srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.srv.server_address[1]}"
        threading.Thread(target=self.srv.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()

    def close(self):
        self.srv.shutdown()
        self.srv.server_close()
