#!/usr/bin/env python3
"""A backend for bench/proxy.sh's failure test: it takes the mock backend's flags, answers
/health and plain completions 200, and answers 503 to every request that came through a PD
proxy (a body carrying `kv_transfer_params`), so a benchmark of the proxy sees only failed
requests while its direct baseline passes."""
import argparse
import json
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args):
        pass

    def answer(self, status, body, ctype="application/json"):
        data = body.encode()
        self.send_response(status)
        self.send_header("content-type", ctype)
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        self.answer(200, json.dumps({"object": "list", "data": [{"id": "bench-mock"}]}))

    def do_POST(self):
        n = int(self.headers.get("content-length", "0"))
        body = json.loads(self.rfile.read(n) or b"{}")
        if "kv_transfer_params" in body:
            self.answer(503, json.dumps({"error": {"message": "overloaded", "code": 503}}))
        elif body.get("stream"):
            self.answer(200, 'data: {"choices":[{"text":" a"}]}\n\ndata: [DONE]\n\n', "text/event-stream")
        else:
            self.answer(200, json.dumps({"choices": [{"index": 0, "text": " a", "finish_reason": "length"}]}))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--host", default="127.0.0.1")
    a, _ = p.parse_known_args()
    ThreadingHTTPServer((a.host, a.port), Handler).serve_forever()


if __name__ == "__main__":
    main()
