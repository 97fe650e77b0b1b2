"""Helpers of the server tests: a real `phloem serve` process, metrics, raw sockets."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

API_KEY = "test-key-123"
READY_TIMEOUT_S = 240


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


ROOT = Path(__file__).resolve().parents[2]


class ServerProcess:
    """`python -m phloem.entrypoints.cli serve ...` on a free loopback port, logging to a file.

    `faults=True` starts the test-only launcher instead (`tests.entrypoints.fault_server`: the
    same server over an engine with `FaultExecutor`, whose marker tokens inject NaN logits or
    kill the engine loop)."""

    def __init__(
        self, args: list[str], log_path: Path, api_key: str | None = None, faults: bool = False
    ) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.api_key = api_key
        self.log_path = log_path
        if faults:
            cmd = [sys.executable, "-m", "tests.entrypoints.fault_server"]
        else:
            cmd = [sys.executable, "-m", "phloem.entrypoints.cli", "serve"]
        cmd += ["--host", "127.0.0.1", "--port", str(self.port), *args]
        cmd += ["--dtype", "float32"]  # tests compare batched and lone outputs token for token
        if api_key:
            cmd += ["--api-key", api_key]
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        self._log = open(log_path, "wb")
        self.proc = subprocess.Popen(
            cmd, stdout=self._log, stderr=subprocess.STDOUT, env=env, cwd=ROOT
        )

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def log_tail(self, n: int = 4000) -> str:
        return self.log_path.read_text(errors="replace")[-n:]

    def wait_ready(self, timeout: float = READY_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        raise RuntimeError(f"server not ready after {timeout} s:\n{self.log_tail()}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self._log.close()

    # -- observation ----------------------------------------------------------------------------

    def metrics(self) -> dict[str, float]:
        """Prometheus series -> value; labels other than model_name are kept in the key."""
        text = httpx.get(self.url + "/metrics", timeout=10).text
        values: dict[str, float] = {}
        for line in text.splitlines():
            if not line or line.startswith("#"):
                continue
            name, value = line.rsplit(" ", 1)
            name = re.sub(r'model_name="[^"]*",?', "", name).replace("{}", "").replace(",}", "}")
            values[name] = float(value)
        return values

    def wait_idle(self, kv_usage: float = 0.0, timeout: float = 30.0) -> dict[str, float]:
        """Wait until nothing runs or waits and KV usage is back to `kv_usage`; returns metrics."""
        deadline = time.monotonic() + timeout
        m: dict[str, float] = {}
        while time.monotonic() < deadline:
            m = self.metrics()
            if (
                m["phloem:num_requests_running"] == 0
                and m["phloem:num_requests_waiting"] == 0
                and abs(m["phloem:kv_cache_usage_perc"] - kv_usage) < 1e-9
            ):
                return m
            time.sleep(0.1)
        raise AssertionError(f"server not idle after {timeout} s: {_gauges(m)}")


def _gauges(m: dict[str, float]) -> dict[str, float]:
    keys = ("phloem:num_requests_running", "phloem:num_requests_waiting")
    return {k: v for k, v in m.items() if k in keys or "kv" in k}


def raw_request(port: int, path: str, body: bytes, headers: dict[str, str] | None = None):
    """Send one HTTP/1.1 POST on a bare socket and return the socket (close it to disconnect)."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=60)
    lines = [
        f"POST {path} HTTP/1.1",
        f"Host: 127.0.0.1:{port}",
        "Content-Type: application/json",
        f"Content-Length: {len(body)}",
    ]
    lines += [f"{k}: {v}" for k, v in (headers or {}).items()]
    sock.sendall(("\r\n".join(lines) + "\r\n\r\n").encode() + body)
    return sock
