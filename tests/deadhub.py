"""A Hugging Face Hub that cannot be reached, on 127.0.0.1 only, for the tests of what llmctl
does online (HF_HUB_OFFLINE unset) on a machine without network (conftest's `dead_hub`)."""


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
