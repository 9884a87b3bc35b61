"""Server processes die with the test run: the harness kills each server's process group when the test process gets
SIGTERM or SIGINT, and a server that is not healthy in time is killed and reported with its last log lines.

A stand-in server (an HTTP server with a child process, like SGLang's launcher and its scheduler) keeps these fast;
the real SGLang servers go through the same ``start_process`` / ``serving`` path.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from harness.server import ServerStartupError, free_port, serving, start_process

TESTS = Path(__file__).resolve().parent

# argv: port, healthy (1/0). Answers /health_generate (200, or 503 when not healthy) and keeps a child process.
FAKE_SERVER = """
import http.server, subprocess, sys
port, healthy = int(sys.argv[1]), sys.argv[2] == "1"
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
print("CHILD", child.pid, flush=True)
for i in range(50):
    print("loading step", i, flush=True)

class Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if healthy else 503)
        self.end_headers()
    def log_message(self, *args):
        pass

http.server.HTTPServer(("127.0.0.1", port), Handler).serve_forever()
"""

# argv: fake server script, log path. Starts it through the harness, prints READY <server pid>, then waits.
DRIVER = """
import os, sys, time
from pathlib import Path
from harness.server import free_port, serving, start_process
port = free_port()
log = Path(sys.argv[2])
proc = start_process([sys.executable, sys.argv[1], str(port), "1"], os.environ, log)
with serving(proc, f"http://127.0.0.1:{port}", log, timeout=60):
    print("READY", proc.pid, flush=True)
    time.sleep(600)
"""


def _alive(pid: int) -> bool:
    """True while ``pid`` runs (a zombie waiting for its reaper counts as dead)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state not in ("Z", "X")


def _wait_dead(pids: list[int], seconds: float = 15.0) -> list[int]:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and any(_alive(p) for p in pids):
        time.sleep(0.1)
    return [p for p in pids if _alive(p)]


@pytest.fixture
def fake_server(tmp_path) -> Path:
    path = tmp_path / "fake_server.py"
    path.write_text(textwrap.dedent(FAKE_SERVER))
    return path


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_server_group_dies_when_the_test_process_is_signalled(sig, fake_server, tmp_path):
    driver = tmp_path / "driver.py"
    driver.write_text(textwrap.dedent(DRIVER))
    log = tmp_path / "server.log"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen([sys.executable, str(driver), str(fake_server), str(log)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        assert line.startswith("READY "), (line, proc.stderr.read() if proc.poll() is not None else "")
        server = int(line.split()[1])
        child = int(next(ln for ln in log.read_text().splitlines() if ln.startswith("CHILD ")).split()[1])
        assert _alive(server) and _alive(child)
        proc.send_signal(sig)
        proc.wait(timeout=30)
        assert proc.returncode != 0
        assert _wait_dead([server, child]) == [], f"still running after {sig.name}: server {server}, child {child}"
    finally:
        if proc.poll() is None:
            proc.kill()


def test_server_group_dies_when_the_test_run_s_parent_is_killed(fake_server, tmp_path):
    """``tests/run.py`` runs pytest as a child; a SIGTERM to run.py alone still ends the servers."""
    driver = tmp_path / "driver.py"
    driver.write_text(textwrap.dedent(DRIVER))
    log = tmp_path / "server.log"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])}
    runner = ("import subprocess, sys; "
              "sys.exit(subprocess.call([sys.executable, sys.argv[1], sys.argv[2], sys.argv[3]]))")
    proc = subprocess.Popen([sys.executable, "-c", runner, str(driver), str(fake_server), str(log)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        assert line.startswith("READY "), (line, proc.stderr.read() if proc.poll() is not None else "")
        server = int(line.split()[1])
        child = int(next(ln for ln in log.read_text().splitlines() if ln.startswith("CHILD ")).split()[1])
        proc.send_signal(signal.SIGTERM)  # the runner only; the driver (the test process) is its child
        proc.wait(timeout=30)
        assert _wait_dead([server, child]) == [], f"still running: server {server}, child {child}"
    finally:
        if proc.poll() is None:
            proc.kill()


def test_startup_timeout_kills_the_server_and_reports_its_last_log_lines(fake_server, tmp_path):
    port, log = free_port(), tmp_path / "server.log"
    proc = start_process([sys.executable, str(fake_server), str(port), "0"], os.environ, log)
    with pytest.raises(ServerStartupError, match="was not healthy after 3 s") as err:
        with serving(proc, f"http://127.0.0.1:{port}", log, timeout=3):
            pass
    child = int(next(ln for ln in log.read_text().splitlines() if ln.startswith("CHILD ")).split()[1])
    assert "loading step 49" in str(err.value)  # the log's last lines
    assert "CHILD" not in str(err.value)  # ... and only those (40 of 51)
    assert _wait_dead([proc.pid, child]) == []
