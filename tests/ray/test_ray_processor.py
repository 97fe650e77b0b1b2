"""phloem on Ray (issue 16): `build_processor` over a prefix-heavy batch gives `LLM.generate`'s
greedy outputs, every planned group's rows on one actor, one row per input row even when an
actor is killed mid-job; `phloem generate --ray-address` runs the JSONL job on the cluster.
One simulated two-node cluster (`ray.cluster_utils.Cluster`, three logical CPUs per node: a
processor's actor takes two, so one actor per node, and the third runs the stages after the
actors, which otherwise waited ~20 s for the pool to let its CPUs go) for the module,
a tiny random-weight Llama (float32). Skipped where Ray is not installed."""

from __future__ import annotations

import json
import os
import random
import signal
import sys
import threading
import time

import pytest

ray = pytest.importorskip("ray")

from phloem import LLM, SamplingParams  # noqa: E402
from phloem.ray import PhloemProcessorConfig, build_processor  # noqa: E402
from tests.engine.tiny_models import VOCAB, tiny_model_dir  # noqa: E402

SETTINGS = dict(block_size=4, dtype="float32", max_num_batched_tokens=64)


@pytest.fixture(scope="module")
def cluster():
    """Two nodes of three CPUs each, this process connected as the driver; shut down at the
    end."""
    from ray.cluster_utils import Cluster

    ray.data.DataContext.get_current().enable_progress_bars = False
    # the workers cannot import this test module: its functions travel by value
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    # a shared test machine's memory is not this cluster's: no OOM killing of its workers
    monkey = pytest.MonkeyPatch()
    monkey.setenv("RAY_memory_monitor_refresh_ms", "0")
    node = {"num_cpus": 3, "object_store_memory": 128 * 1024**2}
    nodes = Cluster(initialize_head=True, head_node_args=node)
    nodes.add_node(**node)
    ray.init(address=nodes.address, log_to_driver=False)
    yield nodes
    ray.shutdown()
    nodes.shutdown()
    monkey.undo()


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory, embedded_tokenizer_dir):
    return tiny_model_dir(tmp_path_factory, embedded_tokenizer_dir, "llama", "llama_ray", 7)


def prefix_heavy_rows(seed: int = 0):
    """Rows of groups sharing a prefix (distinct first tokens, so no two groups share a block)
    and lone prompts, shuffled; greedy, varied max_tokens."""
    rng = random.Random(seed)

    def toks(n):
        return [rng.randrange(3, VOCAB) for _ in range(n)]

    rows = []
    for g, (prefix_len, members) in enumerate([(12, 4), (8, 3), (16, 3), (8, 2)]):
        prefix = [10 + g] + toks(prefix_len - 1)
        for _ in range(members):
            rows.append({"ids": prefix + toks(rng.randrange(1, 6)), "max": rng.randrange(3, 9)})
    for k in range(4):
        rows.append({"ids": [100 + k] + toks(rng.randrange(3, 10)), "max": rng.randrange(3, 9)})
    rng.shuffle(rows)
    return [{"id": f"r{i}", **r} for i, r in enumerate(rows)]


def preprocess(row):
    params = {"temperature": 0, "max_tokens": row["max"], "ignore_eos": True}
    return {"id": row["id"], "prompt_token_ids": row["ids"], "sampling_params": params}


def config(model, **options):
    return PhloemProcessorConfig(
        model_source=str(model), engine_kwargs=SETTINGS, concurrency=2, num_cpus=2, **options
    )


@pytest.fixture(scope="module")
def local_llm(tiny_llama):
    return LLM(str(tiny_llama), **SETTINGS)


def expected_tokens(llm, rows):
    params = [SamplingParams(temperature=0, max_tokens=r["max"], ignore_eos=True) for r in rows]
    outputs = llm.generate([{"prompt_token_ids": r["ids"]} for r in rows], params, use_tqdm=False)
    return {r["id"]: list(o.outputs[0].token_ids) for r, o in zip(rows, outputs)}


def _replica_pids(state: str) -> list[int]:
    """Process ids of this cluster's replica actors whose Ray process title shows `state`
    (".submit": running a batch)."""
    pids = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/cmdline", "rb") as f:
                    title = f.read().decode(errors="replace")
            except OSError:
                continue
            if "MapBatches(PhloemReplica)" in title and state in title:
                pids.append(int(name))
    return pids


def test_processor_matches_generate_groups_on_one_actor_even_when_one_is_killed(
    cluster, tiny_llama, local_llm
):
    """A prefix-heavy batch through two actors (one per node) gives `LLM.generate`'s greedy
    tokens, each planned group's rows on one actor, exactly one row per input row although one
    actor is SIGKILLed while it runs its batch (Ray restarts it and retries the batch)."""
    rows = [{**r, "max": r["max"] + 24} for r in prefix_heavy_rows()]  # a batch lasts a while
    expected = expected_tokens(local_llm, rows)
    processor = build_processor(
        config(tiny_llama, debug_columns=True),
        preprocess=preprocess,
        postprocess=lambda row: {**row, "n": row["num_generated_tokens"]},
    )
    killed: list[int] = []

    def kill_one_running_actor():
        deadline = time.monotonic() + 120
        while not killed and time.monotonic() < deadline:
            for pid in _replica_pids(".submit")[:1]:
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
            time.sleep(0.01)

    killer = threading.Thread(target=kill_one_running_actor, daemon=True)
    killer.start()
    out = processor(ray.data.from_items(rows)).take_all()
    killer.join(timeout=1)
    assert killed, "no actor was seen running a batch"

    assert sorted(r["row_index"] for r in out) == list(range(len(rows)))  # one row per row
    assert {r["id"]: list(r["generated_token_ids"]) for r in out} == expected
    tokenizer = local_llm.get_tokenizer()
    assert all(r["generated_text"] == tokenizer.decode(expected[r["id"]]) for r in out)
    assert all(r["error"] is None and r["n"] == len(r["generated_token_ids"]) for r in out)
    # one global plan; each group's rows met on one actor, and both actors had a share
    plan = processor.last_plan
    assert len(plan.shared_groups) == 4
    actors_of_group: dict[int, set[str]] = {}
    for r in out:
        actors_of_group.setdefault(r["phloem_group"], set()).add(r["phloem_actor_id"])
        assert plan.request_group[r["row_index"]] == r["phloem_group"]
    assert all(len(a) == 1 for a in actors_of_group.values())
    assert len({r["phloem_share"] for r in out}) == 2


def test_generate_ray_address_runs_the_jsonl_job_on_the_cluster(
    cluster, tiny_llama, local_llm, tmp_path
):
    from phloem.entrypoints.cli import main

    prompts = ["the same long prefix of words, then " + w for w in "abcdef"] + ["alone"]
    source = tmp_path / "in.jsonl"
    source.write_text("".join(json.dumps({"id": f"q{i}", "prompt": p}) + "\n"
                              for i, p in enumerate(prompts)))  # fmt: skip
    output, summary = tmp_path / "out.jsonl", tmp_path / "summary.json"
    flags = ["--block-size", "4", "--dtype", "float32", "--max-num-batched-tokens", "64"]
    code = main(
        ["generate", "-i", str(source), "-o", str(output), "--model", str(tiny_llama),
         "--ray-address", cluster.address, "--data-parallel-size", "2", "--no-progress",
         "--max-tokens", "6", "--temperature", "0", "--ignore-eos",
         "--summary-json", str(summary), *flags]
    )  # fmt: skip
    assert code == 0
    llm = local_llm
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    expected = [o.outputs[0].text for o in llm.generate(prompts, greedy, use_tqdm=False)]
    lines = [json.loads(line) for line in output.read_text().splitlines()]
    assert [line["id"] for line in lines] == [f"q{i}" for i in range(len(prompts))]
    assert [line["text"] for line in lines] == expected
    report = json.loads(summary.read_text())["data_parallel"]
    assert report["num_replicas"] == 2
    assert sum(r["num_requests"] for r in report["replicas"]) == len(prompts)
