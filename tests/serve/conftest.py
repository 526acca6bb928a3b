"""Starts `k3 serve` on the built-in tiny model (synthesized into a private K3_CACHE_DIR) on a
free port for the tests of this folder, and stops it with SIGTERM at the end, checking that the
shutdown is graceful."""
import json
import os
import signal
import socket
import subprocess
import time
import urllib.request
from dataclasses import dataclass

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MODEL = "k3-tiny"


def k3_binary():
    path = os.environ.get("K3_BINARY") or os.path.join(ROOT, "build", "k3")
    if not os.access(path, os.X_OK):
        pytest.skip(f"no k3 binary at {path} (build first, or set K3_BINARY)")
    return path


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Server:
    host: str
    port: int
    proc: subprocess.Popen
    log_path: str

    @property
    def url(self):
        return f"http://{self.host}:{self.port}"

    def log(self):
        with open(self.log_path, errors="replace") as f:
            return f.read()

    def raw(self, method, path, body=None, headers=None, timeout=30):
        """One HTTP request without the openai client: (status, parsed JSON or text)."""
        import http.client

        conn = http.client.HTTPConnection(self.host, self.port, timeout=timeout)
        try:
            if isinstance(body, (dict, list)):
                body = json.dumps(body)
            conn.request(method, path, body=body,
                         headers=headers or {"Content-Type": "application/json"})
            res = conn.getresponse()
            data = res.read().decode("utf-8", "replace")
            try:
                return res.status, json.loads(data)
            except ValueError:
                return res.status, data
        finally:
            conn.close()

    def metrics(self):
        """/metrics as {series (name plus labels): value}."""
        with urllib.request.urlopen(self.url + "/metrics", timeout=10) as r:
            text = r.read().decode()
        out = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                name, value = line.rsplit(" ", 1)
                out[name] = float(value)
        return out


@pytest.fixture(scope="session")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("k3serve")
    env = dict(os.environ, K3_CACHE_DIR=str(tmp / "cache"))
    port = free_port()
    log_path = str(tmp / "server.log")
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            [k3_binary(), "serve", "--port", str(port), "--served-model-name", MODEL,
             "--max-num-seqs", "16"],
            env=env, stdout=log, stderr=subprocess.STDOUT)
    srv = Server("127.0.0.1", port, proc, log_path)
    deadline = time.time() + 60
    while True:
        if proc.poll() is not None:
            pytest.fail(f"k3 serve exited with {proc.returncode}:\n{srv.log()}")
        try:
            with urllib.request.urlopen(srv.url + "/health", timeout=2) as r:
                if r.status == 200:
                    break
        except OSError:
            pass
        if time.time() > deadline:
            proc.kill()
            pytest.fail(f"k3 serve did not become healthy:\n{srv.log()}")
        time.sleep(0.1)
    yield srv
    proc.send_signal(signal.SIGTERM)
    try:
        rc = proc.wait(timeout=15)
    except subprocess.TimeoutExpired:
        proc.kill()
        pytest.fail(f"k3 serve did not stop on SIGTERM:\n{srv.log()}")
    assert rc == 0, srv.log()
    assert "shutting down" in srv.log()


@pytest.fixture(scope="session")
def client(server):
    import openai

    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0,
                         timeout=60)
