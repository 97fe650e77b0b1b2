"""Data parallelism under one global prefix plan (`LLM(data_parallel_size=2)`, issue 16): the
same greedy outputs as one engine on a prefix-heavy batch, whole groups per replica, the same
computed prompt tokens; the JSONL job end to end; a replica killed mid-job raises naming it and
the rerun resumes; bad values refused. Replicas are spawned processes on the CPU (a tiny
random-weight Llama, float32), so the module keeps to one two-replica LLM where it can."""

from __future__ import annotations

import json
import os
import random
import re
import signal
import threading
import time

import pytest

from phloem import LLM, SamplingParams
from phloem.engine.data_parallel import replica_placement
from phloem.engine.replica_process import ReplicaError
from phloem.engine_args import EngineArgs
from tests.engine.tiny_models import VOCAB, tiny_model_dir

SETTINGS = dict(block_size=4, dtype="float32", max_num_batched_tokens=64)


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory, embedded_tokenizer_dir):
    return tiny_model_dir(tmp_path_factory, embedded_tokenizer_dir, "llama", "llama_dp", 5)


@pytest.fixture(scope="module")
def one(tiny_llama):
    return LLM(str(tiny_llama), **SETTINGS)


@pytest.fixture(scope="module")
def two(tiny_llama):
    llm = LLM(str(tiny_llama), data_parallel_size=2, **SETTINGS)
    yield llm
    pids = llm.llm_engine.pids
    llm.close()
    for pid in pids:  # no orphans: every replica exited and was reaped
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def prefix_heavy_batch(seed: int = 0):
    """Groups whose prompts share a prefix (distinct first tokens, so no two groups share any
    block), lone prompts, and n > 1; greedy, varied max_tokens."""
    rng = random.Random(seed)

    def toks(n):
        return [rng.randrange(3, VOCAB) for _ in range(n)]

    prompts, params = [], []
    for g, (prefix_len, members) in enumerate([(12, 4), (8, 3), (16, 2), (5, 3)]):
        prefix = [10 + g] + toks(prefix_len - 1)
        for _ in range(members):
            prompts.append(prefix + toks(rng.randrange(1, 6)))
            params.append(
                SamplingParams(temperature=0, max_tokens=rng.randrange(3, 9), ignore_eos=True)
            )
    for k in range(4):
        prompts.append([100 + k] + toks(rng.randrange(3, 10)))
        params.append(
            SamplingParams(temperature=0, max_tokens=rng.randrange(3, 9), ignore_eos=True)
        )
    params[1] = SamplingParams(temperature=0, max_tokens=5, n=2, ignore_eos=True)
    params[-1] = SamplingParams(temperature=0, max_tokens=4, n=3, ignore_eos=True)
    order = list(range(len(prompts)))
    rng.shuffle(order)  # the plan, not the input order, must bring the groups together
    return [{"prompt_token_ids": prompts[i]} for i in order], [params[i] for i in order]


def _tokens(outputs):
    return [[c.token_ids for c in o.outputs] for o in outputs]


def test_same_outputs_whole_groups_same_computed_tokens(one, two):
    prompts, params = prefix_heavy_batch()
    before = one.llm_engine.num_computed_prompt_tokens
    expected = one.generate(prompts, params, use_tqdm=False)
    computed_one = one.llm_engine.num_computed_prompt_tokens - before
    before = two.llm_engine.num_computed_prompt_tokens
    got = two.generate(prompts, params, use_tqdm=False)
    assert _tokens(got) == _tokens(expected)
    assert [o.prompt_token_ids for o in got] == [o.prompt_token_ids for o in expected]
    assert [[c.text for c in o.outputs] for o in got] == [
        [c.text for c in o.outputs] for o in expected
    ]

    report = two.last_replica_report
    assert one.last_replica_report is None
    # one global plan, the same as one engine's; every group ran on one replica
    assert two.last_plan.groups == one.last_plan.groups
    replicas_of_group: dict[int, set[int]] = {}
    for i, g in enumerate(report.request_group):
        replicas_of_group.setdefault(g, set()).add(report.request_replica[i])
    assert all(len(r) == 1 for r in replicas_of_group.values())
    assert {s.replica for s in report.replicas if s.num_requests} == {0, 1}
    assert sum(s.num_requests for s in report.replicas) == len(prompts)
    # each shared prefix computed once in the cluster: the same prompt tokens as one engine
    computed_two = two.llm_engine.num_computed_prompt_tokens - before
    assert (
        computed_two == computed_one == sum(s.num_computed_prompt_tokens for s in report.replicas)
    )
    assert 1.0 <= report.planned_imbalance < 1.5
    assert all(s.achieved_s > 0 for s in report.replicas)
    # the dispatch, timed: each share sent, then unpacked and queued in its replica
    assert all(0 < s.sent_s and 0 < s.received_s <= s.queued_s for s in report.replicas)
    assert report.dispatch_s == max(s.queued_s for s in report.replicas) > report.deal_s > 0
    summary = report.to_dict()
    assert summary["num_replicas"] == 2 and len(summary["replicas"]) == 2


def test_early_end_aborts_and_the_next_batch_runs(one, two):
    """The replicas look at their pipe after every step: breaking out of a batch whose other
    requests run for hundreds of steps reaches them mid-request, and they answer (so they are
    not stopped: the same processes run the next batch)."""
    prompts, params = prefix_heavy_batch(seed=1)
    batch = [({"prompt_token_ids": p["prompt_token_ids"]}) for p in prompts]
    encoded = [(None, p["prompt_token_ids"]) for p in batch]
    long = [SamplingParams(temperature=0, max_tokens=400, ignore_eos=True) for _ in params]
    long[0] = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    pids = two.llm_engine.pids
    for _ in two.run_batch(lambda: (encoded, long), use_tqdm=False):
        break  # the replicas abort their shares
    assert two.llm_engine.pids == pids
    assert _tokens(two.generate(batch, params, use_tqdm=False)) == _tokens(
        one.generate(batch, params, use_tqdm=False)
    )


def _write_job(path, lines):
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))


def test_generate_cli_end_to_end(tiny_llama, tmp_path):
    from phloem.entrypoints.cli import main

    lines = [{"id": f"a{i}", "prompt": f"The shared instructions of task A. Item {i}:"}
             for i in range(4)]  # fmt: skip
    lines += [{"id": f"b{i}", "prompt": f"Another, different preamble for B; question {i}?",
               "max_tokens": 3 + i} for i in range(3)]  # fmt: skip
    lines += [{"id": "lone", "prompt": "Hello", "n": 2}, {"prompt": ""}]
    _write_job(tmp_path / "in.jsonl", lines)
    flags = ["--model", str(tiny_llama), "--block-size", "4", "--dtype", "float32",
             "--max-tokens", "6", "--temperature", "0", "--ignore-eos", "--no-progress"]  # fmt: skip
    runs = {}
    for dp in (1, 2):
        out, summary = tmp_path / f"out{dp}.jsonl", tmp_path / f"summary{dp}.json"
        argv = ["generate", "-i", str(tmp_path / "in.jsonl"), "-o", str(out),
                "--summary-json", str(summary), "--data-parallel-size", str(dp), *flags]  # fmt: skip
        assert main(argv) == 0
        runs[dp] = out.read_text(), json.loads(summary.read_text())
    assert runs[2][0] == runs[1][0]
    assert "data_parallel" not in runs[1][1]
    report = runs[2][1]["data_parallel"]
    assert report["num_replicas"] == 2
    assert sum(r["num_requests"] for r in report["replicas"]) == len(lines) - 1
    assert report["planned_imbalance"] >= 1.0 and report["achieved_imbalance"] >= 1.0
    assert runs[2][1]["num_computed_prompt_tokens"] == runs[1][1]["num_computed_prompt_tokens"]


def test_killed_replica_raises_naming_it_and_the_job_resumes(two, tmp_path):
    from phloem.entrypoints.generate import run_generate

    # two long requests per replica (LPT deals the four long ones two and two) and short ones,
    # so the first result is written while replica 1 still has long work
    lines = [{"id": f"long{i}", "prompt": f"{i} long", "max_tokens": 300} for i in range(4)]
    lines += [{"id": f"short{i}", "prompt": f"short {i}!", "max_tokens": 1} for i in range(4)]
    _write_job(tmp_path / "in.jsonl", lines)
    paths = str(tmp_path / "in.jsonl"), str(tmp_path / "out.jsonl")
    victim = two.llm_engine.pids[1]
    partial = tmp_path / "out.jsonl.partial"

    def kill_after_first_result():
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if partial.exists() and partial.stat().st_size > 0:
                os.kill(victim, signal.SIGKILL)
                return
            time.sleep(0.005)

    killer = threading.Thread(target=kill_after_first_result)
    killer.start()
    defaults = {"ignore_eos": True, "temperature": 0}
    with pytest.raises(ReplicaError, match=rf"replica 1 \(pid {victim}\) died during a batch"):
        run_generate(two, *paths, defaults, use_tqdm=False)
    killer.join()
    saved = [json.loads(line) for line in partial.read_text().splitlines()]
    assert 0 < len(saved) < len(lines)

    summary = run_generate(two, *paths, defaults, use_tqdm=False)  # replica 1 starts again
    assert two.llm_engine.pids[1] != victim
    assert summary["num_requests"] == len(lines) - len(saved)
    out = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert [r["id"] for r in out] == [line["id"] for line in lines]
    assert [r["num_output_tokens"] for r in out] == [line["max_tokens"] for line in lines]


def test_bad_values_are_refused(tiny_llama, tmp_path):
    for value in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match=r"data_parallel_size must be an integer >= 1"):
            EngineArgs(data_parallel_size=value).create_engine_config()
    with pytest.raises(ValueError, match="data_parallel_size"):
        LLM(str(tiny_llama), data_parallel_size=0)
    with pytest.raises(ValueError, match=r"data_parallel_size=3 needs 3 CUDA devices .*2 are"):
        replica_placement("cuda", 3, 2, None)
    with pytest.raises(ValueError, match=r"data_parallel_size=2 needs 2 CUDA devices .*0 are"):
        replica_placement("cuda", 2, 0, None)
    with pytest.raises(ValueError, match=r"needs 4 CUDA devices \(2 devices per replica \(TP=2"):
        replica_placement("cuda", 2, 3, None, devices_per_replica=2)
    placed = replica_placement("auto", 2, 4, "4,5,6,7", devices_per_replica=2)
    assert [p["CUDA_VISIBLE_DEVICES"] for p in placed] == ["4,5", "6,7"]
    assert replica_placement("auto", 2, 0, None) == [{"PHLOEM_DEVICE": "cpu"}] * 2
    assert replica_placement("cpu", 2, 8, None) == [{"PHLOEM_DEVICE": "cpu"}] * 2
    assert [p["CUDA_VISIBLE_DEVICES"] for p in replica_placement("auto", 2, 4, "4,5,6,7")] == [
        "4",
        "5",
    ]
    assert [p["CUDA_VISIBLE_DEVICES"] for p in replica_placement("cuda", 3, 3, None)] == [
        "0",
        "1",
        "2",
    ]


def test_broken_replica_cli_plan_only_starts_none_and_failure_prints_traceback(
    tiny_llama, tmp_path, capsys
):
    """The parent reads only the config and tokenizer; the replicas load the weights, so a
    truncated checkpoint fails in them. `--plan-only` starts no replica (so it succeeds and
    prints the deal), while the job fails with one line naming the replica and what is saved,
    then the replica's traceback (exit 1); `LLM(...)` raises ReplicaError with it as cause."""
    import shutil

    from phloem.engine.replica_process import RemoteTraceback
    from phloem.entrypoints.cli import main

    broken = tmp_path / "broken"
    shutil.copytree(tiny_llama, broken)
    weights = broken / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    lines = [{"id": f"q{i}", "prompt": f"A shared preamble of this job, then item {i}"}
             for i in range(5)]  # fmt: skip
    _write_job(tmp_path / "in.jsonl", lines)
    argv = ["generate", "-i", str(tmp_path / "in.jsonl"), "-o", str(tmp_path / "out.jsonl"),
            "--model", str(broken), "--block-size", "4", "--dtype", "float32", "--max-tokens",
            "3", "--no-progress", "--data-parallel-size", "2"]  # fmt: skip
    assert main([*argv, "--plan-only"]) == 0
    printed = capsys.readouterr().out
    assert "prefix plan: 5 requests" in printed
    assert "data-parallel deal (prefix routing) over 2 replicas" in printed
    assert "replica 0:" in printed and "replica 1:" in printed

    assert main(argv) == 1
    err = capsys.readouterr().err.splitlines()
    first = next(i for i, line in enumerate(err) if line.startswith("error: "))
    assert re.match(r"error: data-parallel replica \d failed to start: ValueError: .*safetensors"
                    r".*; 0 of 5 lines saved in .*; rerun the same command", err[first])  # fmt: skip
    assert re.match(r"replica \d's traceback:", err[first + 1])
    assert err[first + 2] == "Traceback (most recent call last):"
    assert any("safetensors" in line for line in err[first + 3 :])

    with pytest.raises(ReplicaError, match=r"replica \d failed to start: ValueError: .*") as info:
        LLM(str(broken), data_parallel_size=2, **SETTINGS)
    assert "\n" not in str(info.value)  # one line; the traceback is the cause
    assert isinstance(info.value.__cause__, RemoteTraceback)
    assert "Traceback (most recent call last)" in info.value.remote_traceback


def test_one_group_is_split_so_both_replicas_work(one, two):
    """One prefix group and two replicas: the group is split, both replicas run half of it and
    each computes the prefix once; outputs as one engine's."""
    rng = random.Random(7)
    prefix = [rng.randrange(3, VOCAB) for _ in range(24)]
    prompts = [{"prompt_token_ids": prefix + [rng.randrange(3, VOCAB) for _ in range(3)]}
               for _ in range(6)]  # fmt: skip
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    before = one.llm_engine.num_computed_prompt_tokens
    expected = one.generate(prompts, params, use_tqdm=False)
    computed_one = one.llm_engine.num_computed_prompt_tokens - before
    got = two.generate(prompts, params, use_tqdm=False)
    assert _tokens(got) == _tokens(expected)
    report = two.last_replica_report
    assert len(two.last_plan.groups) == 1 and report.deal.num_split_groups == 1
    assert [s.num_requests for s in report.replicas] == [3, 3]
    prefix_len = two.last_plan.groups[0].prefix_len
    assert report.deal.planned_computed_prompt_tokens == computed_one + prefix_len
    # measured: each replica queued its half under the driver's plan: the prefix once each
    assert report.num_computed_prompt_tokens == computed_one + prefix_len
    assert report.to_dict()["num_split_groups"] == 1


def test_single_engine_apis_refuse_replicas(two):
    with pytest.raises(RuntimeError, match="data_parallel_size > 1 use generate"):
        two.add_requests([(None, [5, 6, 7])], [SamplingParams(max_tokens=2)])


def test_run_batch_job_same_as_one_engine(one, two, tmp_path):
    from phloem.entrypoints.run_batch import run_batch

    shared = "You are a careful assistant. Answer in one word. "
    lines = [
        {"custom_id": f"c{i}", "method": "POST", "url": "/v1/completions",
         "body": {"prompt": f"{shared}Question {i}", "max_tokens": 4 + i, "temperature": 0}}
        for i in range(4)
    ] + [
        {"custom_id": "chat", "method": "POST", "url": "/v1/chat/completions",
         "body": {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 5,
                  "temperature": 0, "n": 2}},
    ]  # fmt: skip
    _write_job(tmp_path / "in.jsonl", lines)
    bodies = {}
    for name, llm in (("one", one), ("two", two)):
        out = tmp_path / f"{name}.jsonl"
        counts = run_batch(llm, str(tmp_path / "in.jsonl"), str(out), "m", use_tqdm=False)
        assert counts["num_completed"] == len(lines)
        records = [json.loads(line) for line in out.read_text().splitlines()]
        bodies[name] = sorted(  # a Batch API output is in completion order
            (r["custom_id"], [c.get("text") or c["message"]["content"]
                              for c in r["response"]["body"]["choices"]])
            for r in records
        )  # fmt: skip
    assert bodies["two"] == bodies["one"]
    assert two.generate([], use_tqdm=False) == []  # an empty batch (a finished job's rerun)


def test_close_stops_even_a_stopped_replica(two, monkeypatch):
    """The last test of the module: close() returns with every replica process exited, even one
    that cannot answer (SIGSTOP: it is terminated after the grace, then killed). Shorter graces
    than the shipped 5 s + 2 s: the stopped replica takes the same path through each."""
    from phloem.engine import replica_process

    monkeypatch.setattr(replica_process, "STOP_GRACE_S", 1.0)
    monkeypatch.setattr(replica_process, "KILL_GRACE_S", 0.5)
    processes = [r.process for r in two.llm_engine._replicas]
    os.kill(processes[1].pid, signal.SIGSTOP)
    two.close()
    assert all(p.exitcode is not None for p in processes)
    assert processes[1].exitcode == -signal.SIGKILL  # SIGTERM stays pending while stopped
