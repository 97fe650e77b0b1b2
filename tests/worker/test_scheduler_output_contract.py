"""The scheduler -> worker contract is plain data: every `SchedulerOutput` of a CPU run pickles,
round-trips, holds no live scheduler object and is not mutated after it is launched; and a
worker in another process (spawn), fed the pickled outputs in the same launch/collect order,
samples exactly the tokens the in-process worker sampled."""

from __future__ import annotations

import multiprocessing
import pickle
import random

import pytest

from phloem import SamplingParams
from phloem.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from phloem.core.prefix_planner import plan_prefix_groups
from phloem.core.request import SharedPrefix
from phloem.engine.executor import UniProcExecutor
from phloem.engine.llm_engine import LLMEngine
from tests.engine.tiny_models import VOCAB, tiny_model_dir

NUM_BLOCKS = 24  # small enough that the run preempts (admission by count, not memory)
BLOCK_SIZE = 4


class RecordingExecutor(UniProcExecutor):
    """The default executor, recording each call: ("launch", pickled output at launch time,
    the output) and ("collect", launch index, the runner output)."""

    def __init__(self, worker) -> None:
        super().__init__(worker)
        self.calls: list[tuple] = []
        self._launches: dict[int, int] = {}  # id(handle) -> launch index

    def launch(self, scheduler_output):
        index = sum(1 for c in self.calls if c[0] == "launch")
        self.calls.append(("launch", pickle.dumps(scheduler_output), scheduler_output))
        handle = super().launch(scheduler_output)
        if handle is not None:
            self._launches[id(handle)] = index
        return handle

    def collect(self, launched):
        out = super().collect(launched)
        if launched is not None:
            self.calls.append(("collect", self._launches.pop(id(launched)), out))
        return out


def config(path, async_scheduling: bool, prefix_caching: bool) -> EngineConfig:
    return EngineConfig(
        model=ModelConfig(str(path)),
        cache=CacheConfig(
            block_size=BLOCK_SIZE, num_gpu_blocks=NUM_BLOCKS, enable_prefix_caching=prefix_caching
        ),
        scheduler=SchedulerConfig(
            max_num_batched_tokens=24,
            async_scheduling=async_scheduling,
            memory_centric_admission=False,
        ),
        seed=7,
    )


def workload() -> tuple[list[list[int]], list[SamplingParams]]:
    rng = random.Random(1)
    system = [rng.randrange(3, VOCAB) for _ in range(20)]
    prompts = [
        (system if i % 3 else []) + [rng.randrange(3, VOCAB) for _ in range(rng.randint(2, 14))]
        for i in range(9)
    ]
    greedy = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    params = [greedy] * 9
    params[1] = SamplingParams(temperature=0.8, seed=3, n=3, max_tokens=12, ignore_eos=True)
    params[4] = SamplingParams(
        temperature=0.7, seed=5, repetition_penalty=1.3, presence_penalty=0.4, max_tokens=9,
        min_tokens=4, ignore_eos=True,
    )  # fmt: skip
    params[6] = SamplingParams(temperature=0, max_tokens=8, logprobs=2, ignore_eos=True)
    return prompts, params


def run(path, async_scheduling: bool, prefix_sharing: bool) -> tuple[LLMEngine, dict]:
    """The workload through an engine with a recording executor; planned prefix groups (as
    `LLM.add_requests` makes them) when `prefix_sharing`. Returns the engine and the outputs."""
    engine = LLMEngine(
        config(path, async_scheduling, prefix_sharing), executor_factory=RecordingExecutor
    )
    prompts, params = workload()
    order, groups = range(len(prompts)), {}
    if prefix_sharing:
        plan = plan_prefix_groups(prompts, [p.max_tokens for p in params], BLOCK_SIZE)
        order = plan.order
        for group in plan.shared_groups:
            shared = SharedPrefix(group.prefix_len, num_unfinished=len(group.request_indices))
            groups.update({i: shared for i in group.request_indices})
    for i in order:
        engine.add_request(prompts[i], params[i], request_id=str(i), shared_prefix=groups.get(i))
    outputs = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            outputs[out.request_id] = [c.token_ids for c in out.outputs]
    engine.scheduler.check_integrity()
    return engine, outputs


CASES = [(a, p) for a in (False, True) for p in (False, True)]
IDS = [f"{'async' if a else 'sync'}-{'sharing' if p else 'plain'}" for a, p in CASES]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, embedded_tokenizer_dir):
    return tiny_model_dir(tmp_path_factory, embedded_tokenizer_dir, "llama", "llama_contract", 4)


@pytest.fixture(scope="module")
def runs(model_dir):
    return {case: run(model_dir, *case) for case in CASES}


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_every_scheduler_output_is_plain_data(runs, case):
    engine, outputs = runs[case]
    assert len(outputs) == 9 and all(outputs.values())
    assert engine.scheduler.num_preemptions > 0  # the run covers preemption
    launches = [c for c in engine.executor.calls if c[0] == "launch"]
    assert any(s.new_sequence is not None for _, _, out in launches for s in out.scheduled)
    if case[1]:
        assert any(s.prefix_len > 0 for _, _, out in launches for s in out.scheduled)
    for _, at_launch, out in launches:
        assert b"phloem.core.request" not in at_launch  # no Request, no SharedPrefix
        assert pickle.loads(at_launch) == out  # round trip, and not mutated since its launch


def test_outputs_do_not_depend_on_async_scheduling_or_prefix_sharing(runs):
    greedy = [{k: v for k, v in outputs.items() if k not in ("1", "4")} for _, outputs in
              runs.values()]  # fmt: skip
    assert all(g == greedy[0] for g in greedy)


def _replay(path, async_scheduling, prefix_sharing, eos_token_id, calls, conn) -> None:
    """In a spawned process: a fresh worker, fed the pickled outputs in the recorded order;
    sends back each collected step's runner output."""
    import torch

    from phloem.models.loader import load_hf_config, resolve_model, startup_source
    from phloem.worker.worker import Worker

    torch.set_num_threads(1)
    cfg = config(path, async_scheduling, prefix_sharing)
    source = startup_source(resolve_model(cfg.model.model), cfg.model)
    worker = Worker(
        cfg.model, cfg.cache, source, load_hf_config(source), cfg.seed, eos_token_id,
        scheduler_config=cfg.scheduler,
    )  # fmt: skip
    runner = worker.model_runner
    handles, collected = [], []
    for kind, payload in calls:
        if kind == "launch":
            handles.append(runner.launch(pickle.loads(payload)))
        else:
            collected.append((payload, runner.collect(handles[payload])))
    conn.send(pickle.dumps(collected))
    conn.close()


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_a_worker_in_another_process_samples_the_same_tokens(model_dir, runs, case):
    engine, _ = runs[case]
    calls = [(kind, payload) for kind, payload, _ in engine.executor.calls]
    expected = [(payload, out) for kind, payload, out in engine.executor.calls if kind == "collect"]
    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe(duplex=False)
    process = ctx.Process(
        target=_replay, args=(str(model_dir), *case, engine.eos_token_id, calls, child)
    )
    process.start()
    child.close()
    try:
        got = pickle.loads(parent.recv())
    finally:
        process.join(timeout=120)
    assert process.exitcode == 0
    assert [i for i, _ in got] == [i for i, _ in expected]
    for (_, want), (_, out) in zip(expected, got):
        assert out.sampled_token_ids == want.sampled_token_ids
        assert out.failed == want.failed
