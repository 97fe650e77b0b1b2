"""`phloem serve --tensor-parallel-size 2` with the engine core in its own process (the default):
the core is not a daemon, so it can start its rank processes; greedy completions equal the
offline TP = 1 engine's, and stopping the server leaves no core or rank process behind."""

from __future__ import annotations

import re
import time
from pathlib import Path

import httpx

from phloem import LLM, SamplingParams
from tests.distributed.test_tensor_parallel import write_model
from tests.entrypoints.server_utils import ServerProcess

PROMPTS = ["t5 t9 t11 t3", "t7 t7 t2 t40 t41 t42", "t100"]


def children(pid: int) -> list[int]:
    """Direct child processes of `pid` (Linux /proc)."""
    found = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        found += [int(c) for c in (task / "children").read_text().split()]
    return found


def alive(pid: int) -> bool:
    """Running (a zombie, exited but not yet reaped, counts as gone)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def test_tp2_server_matches_offline_tp1_and_leaves_no_process(tmp_path, embedded_tokenizer_dir):
    model = tmp_path / "m"
    write_model("llama", model, embedded_tokenizer_dir, num_kv_heads=2)
    args = [
        "--model", str(model), "--device", "cpu", "--tensor-parallel-size", "2",
        "--block-size", "4", "--max-num-seqs", "8",
    ]  # fmt: skip
    server = ServerProcess(args, tmp_path / "server.log")
    try:
        server.wait_ready()
        core = int(re.search(r"engine core pid (\d+)", server.log_tail(100_000)).group(1))
        ranks = children(core)
        assert ranks, "the TP=2 engine core started no rank process"
        body = {"max_tokens": 6, "temperature": 0, "ignore_eos": True}
        served = [
            httpx.post(f"{server.url}/v1/completions", json={"prompt": p, **body}, timeout=120)
            for p in PROMPTS
        ]
    finally:
        server.stop()
    assert server.proc.returncode == 0, server.log_tail()
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and any(alive(p) for p in [core, *ranks]):
        time.sleep(0.2)
    assert not [p for p in [core, *ranks] if alive(p)], "processes left behind"
    llm = LLM(str(model), dtype="float32", block_size=4)
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    outputs = llm.generate(PROMPTS, params, use_tqdm=False)
    for response, output in zip(served, outputs):
        assert response.status_code == 200, response.text
        assert response.json()["choices"][0]["text"] == output.outputs[0].text
