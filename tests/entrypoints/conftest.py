"""Real `phloem serve` processes on 127.0.0.1 (random free ports) for the server tests.

`main_server` (session): the embedded model, max_model_len 512, an API key. `small_server` (module): 2 sequences at most and a 16-block KV pool, so requests wait
and get preempted. Tests that kill the server, or inject faults (`ServerProcess(faults=True)`),
start their own.
"""

from __future__ import annotations

import httpx
import pytest

from tests.entrypoints.server_utils import API_KEY, ServerProcess


@pytest.fixture(scope="session")
def main_server(tmp_path_factory):
    server = ServerProcess(
        ["--max-model-len", "512"], tmp_path_factory.mktemp("main") / "server.log", API_KEY
    )
    try:
        server.wait_ready()
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def small_server(tmp_path_factory):
    server = ServerProcess(
        ["--max-model-len", "256", "--max-num-seqs", "2", "--num-gpu-blocks", "16"],
        tmp_path_factory.mktemp("small") / "server.log",
    )
    try:
        server.wait_ready()
        yield server
    finally:
        server.stop()


@pytest.fixture
def client(main_server):
    with httpx.Client(base_url=main_server.url, headers=main_server.headers, timeout=120) as c:
        yield c


@pytest.fixture
def openai_client(main_server):
    import openai

    return openai.OpenAI(base_url=main_server.url + "/v1", api_key=API_KEY, max_retries=0)
