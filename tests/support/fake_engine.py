"""A fake llama-server program for the engine and CLI tests, and the process checks they share."""

from __future__ import annotations

import http.client
import time
from pathlib import Path

FAKE_SERVER = """\
#!{python}
# A stand-in llama-server: records how it was called, then behaves as FAKE_MODE says.
import http.server, json, os, signal, sys, time

args = sys.argv[1:]
with open(os.environ["FAKE_RECORD"], "w") as record:
    json.dump({{"argv": args, "pid": os.getpid(), "env": dict(os.environ)}}, record)
mode = os.environ.get("FAKE_MODE", "serve")
if os.environ.get("FAKE_AWAIT"):  # goes on once the fake that FAKE_AWAIT names has recorded
    while not os.path.exists(os.environ["FAKE_AWAIT"]):
        time.sleep(0.02)
if mode == "fail":
    print("I load_model: loading model", file=sys.stderr, flush=True)
    print("E load_model: failed to load model 'x'", file=sys.stderr, flush=True)
    print("E init: exiting due to model loading error", file=sys.stderr, flush=True)
    sys.exit(1)
if mode == "abort":  # GGML_ABORT's line, then the debugger's backtrace it runs
    print("I init: llama threadpool init, n_threads = 1", file=sys.stderr)
    print("/src/llama.cpp/common/common.cpp:2245: get_sub_batch: failed to add token 1",
          file=sys.stderr)
    for frame in range(30):
        print(f"#{{frame}} 0x00007f4a75245305 in somewhere ()", file=sys.stderr)
    print("[Inferior 1 (process 11290) detached]", file=sys.stderr, flush=True)
    os.abort()
if mode == "stubborn":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
if mode == "mute":
    while True:
        time.sleep(1)

class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        if self.path == "/props":  # enough of it for a gate in front
            slots = int(args[args.index("-np") + 1])
            body = json.dumps({{"total_slots": slots, "model_path": args[1]}}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
            return
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()
        self.wfile.write(b'{{"status":"ok"}}')

    def log_message(self, *args):
        pass

server = http.server.HTTPServer(("127.0.0.1", int(args[args.index("--port") + 1])), Health)
print("0.00.002.530 W srv init: security: no API key is set and CORS allows all origins",
      file=sys.stderr, flush=True)
print("W load: control-looking token:    212 '</s>' was not control-type", file=sys.stderr)
print("I srv init: chat template, example_format: '<start_of_turn>user", file=sys.stderr)
print("Hello<end_of_turn>'", file=sys.stderr)
print("W srv init: fake llama-server listening", file=sys.stderr, flush=True)
server.serve_forever()
"""


def running(pid: int) -> bool:
    """The process exists and is not a zombie (a zombie has ended; it only awaits its reaper)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")


def wait_gone(pid: int, timeout_s: float = 10) -> None:
    deadline = time.monotonic() + timeout_s
    while running(pid):
        assert time.monotonic() < deadline, f"process {pid} is still running"
        time.sleep(0.02)


def health(url: str) -> int:
    host, port = url.removeprefix("http://").split(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=5)
    try:
        connection.request("GET", "/health")
        return connection.getresponse().status
    finally:
        connection.close()
