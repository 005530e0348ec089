"""A fake replica on loopback that answers /metrics the ways a broken or hostile one does, one per path:
`python -m tests.hostile_replica PORT`. Paths (each ends in /metrics): /endless (a valid body that never
ends), /huge (50 MB of valid text, declared), /huge-chunked (the same, undeclared), /trickle (a byte every
1.5 s), /garbage (bytes that are not Prometheus text), /fine (a small valid body)."""

from __future__ import annotations

import sys
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

LINE = b'vllm:num_requests_running{model_name="hostile"} 1\n'
HUGE = 50 * 2**20


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.0"  # the body ends when the connection does (no length needed)

    def log_message(self, *args: object) -> None:
        pass

    def do_GET(self) -> None:
        kind = self.path.removesuffix("/metrics").strip("/")
        self.send_response(200)
        self.send_header("Content-Type", "text/plain; version=0.0.4")
        if kind == "huge":
            self.send_header("Content-Length", str(HUGE // len(LINE) * len(LINE)))
        self.end_headers()
        try:
            if kind in ("endless", "huge", "huge-chunked"):
                block = b"# TYPE vllm:num_requests_running gauge\n" + LINE * (2**16 // len(LINE))
                sent = 0
                while kind == "endless" or sent + len(block) <= HUGE:
                    self.wfile.write(block)
                    sent += len(block)
            elif kind == "trickle":
                for byte in LINE:
                    self.wfile.write(bytes([byte]))
                    self.wfile.flush()
                    time.sleep(1.5)  # the hostile replica's pace, not a test's synchronisation
            elif kind == "garbage":
                self.wfile.write(b"\x00\x01 this is { not prometheus\n" * 100)
            else:
                self.wfile.write(b"# TYPE vllm:num_requests_running gauge\n" + LINE)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the console gave up on it, as it should


if __name__ == "__main__":
    server = ThreadingHTTPServer(("127.0.0.1", int(sys.argv[1])), Handler)
    server.daemon_threads = True
    print("ready", flush=True)
    server.serve_forever()
