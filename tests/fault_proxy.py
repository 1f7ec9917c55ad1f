"""A loopback HTTP proxy in front of a storage server (tests/storage_servers.py) that answers
what a test tells it to instead of forwarding: a status such as 503 or 429 (with the body a
cloud's front end sends), for every request while set, or each answer late by `delay` seconds (a
slow server), or a status to the writes of some objects only (a bucket failing mid-save). The
storage servers cannot be made to answer so themselves; the libraries see a real HTTP exchange
either way.

    with FaultProxy(server.url) as proxy:      # point the variables at proxy.url
        proxy.status = 503                     # every request answered 503 from now on
        proxy.delay = 0.5                      # or: every answer half a second late
        proxy.writes_status = 503              # or: writes (POST, PUT, PATCH, DELETE) whose
        proxy.writes_matching = r"run/[3-9]"   # URL-decoded target matches, answered 503
"""

import collections
import http.client
import http.server
import re
import threading
import time
import urllib.parse

from tests.storage_servers import free_port

# A body in the form each API's clients parse for an error's words.
_BODY = b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>SlowDown</Code>' \
        b'<Message>injected by tests/fault_proxy.py</Message></Error>'

_WRITES = frozenset({"POST", "PUT", "PATCH", "DELETE"})


class FaultProxy:
    def __init__(self, upstream: str):
        self.upstream = urllib.parse.urlsplit(upstream)
        self.status = 0  # 0: forward every request
        self.delay = 0.0  # seconds each answer waits (requests in flight wait together)
        self.requests = 0
        self.writes_status = 0  # 0: forward every write
        self.writes_matching = ""  # a regex, searched in a write's URL-decoded target
        self.failed_writes = collections.Counter()  # URL-decoded target: answered `writes_status`
        proxy = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def _any(self):
                proxy.requests += 1
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else None
                time.sleep(proxy.delay)
                status = proxy.status or self._write_status()
                if status:
                    self.send_response(status)
                    self.send_header("Content-Length", str(len(_BODY)))
                    self.send_header("Content-Type", "application/xml")
                    self.end_headers()
                    if self.command != "HEAD":  # an answer to HEAD has headers only
                        self.wfile.write(_BODY)
                    return
                upstream = http.client.HTTPConnection(proxy.upstream.hostname,
                                                      proxy.upstream.port, timeout=30)
                headers = {k: v for k, v in self.headers.items() if k.lower() != "host"}
                upstream.request(self.command, self.path, body=body, headers=headers)
                answer = upstream.getresponse()
                data = answer.read()
                self.send_response(answer.status)
                for k, v in answer.getheaders():
                    if k.lower() not in ("transfer-encoding", "content-length", "connection"):
                        self.send_header(k, v)
                self.send_header("Content-Length", answer.getheader("Content-Length", "0")
                                 if self.command == "HEAD" else str(len(data)))
                self.end_headers()
                self.wfile.write(data)
                upstream.close()

            def _write_status(self) -> int:
                if not proxy.writes_status or self.command not in _WRITES or not re.search(
                        proxy.writes_matching, urllib.parse.unquote(self.path)):
                    return 0
                proxy.failed_writes[urllib.parse.unquote(self.path)] += 1
                return proxy.writes_status

            do_GET = do_PUT = do_POST = do_HEAD = do_DELETE = do_PATCH = _any

        self._server = http.server.ThreadingHTTPServer(("127.0.0.1", free_port()), Handler)
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"

    def __enter__(self):
        threading.Thread(target=self._server.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc):
        self._server.shutdown()
        self._server.server_close()
