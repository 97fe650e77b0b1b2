"""The engine core's side of the process split (issue 24): `LLMEngine` in DELTA mode sends
token deltas whose concatenation is the offline (FINAL) output, applies no stop strings, and
`stop_sequences` finishes one child of n > 1 (or the whole prompt) the way the front asks; the
messages round-trip through msgspec; and the core's loop builds the next step late enough that a
request arriving while a step runs is in the step right after it."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import msgspec
import pytest
import zmq

from phloem import SamplingParams
from phloem.core.scheduler_output import SchedulerOutput
from phloem.engine.core_messages import (
    CoreAbort,
    CoreRequest,
    CoreShutdown,
    CoreStats,
    CoreStep,
    RequestDelta,
    SeqDelta,
    core_decoder,
    front_decoder,
    params_to_dict,
)
from phloem.engine.engine_core import EngineCore, StepPacing
from phloem.engine.executor import UniProcExecutor
from phloem.engine.llm_engine import LLMEngine, OutputMode
from phloem.engine.step_observer import StepRecord
from phloem.engine_args import EngineArgs
from tests.engine.tiny_models import tiny_model_dir

PROMPT = [3, 40, 41, 42, 43, 44, 45, 5]


@pytest.fixture(scope="module")
def model_path(tmp_path_factory, embedded_tokenizer_dir):
    return tiny_model_dir(tmp_path_factory, embedded_tokenizer_dir, "llama", "llama_core", 6)


def engine(model_path, mode: OutputMode) -> LLMEngine:
    args = EngineArgs(str(model_path), block_size=4, max_num_batched_tokens=32)
    return LLMEngine(args.create_engine_config(), output_mode=mode)


def run(engine: LLMEngine) -> list:
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    return outputs


def test_deltas_add_up_to_the_offline_output(model_path):
    params = SamplingParams(n=2, temperature=0.8, seed=7, max_tokens=12, logprobs=1, stop=["a"])
    final = engine(model_path, OutputMode.FINAL)
    final.add_request(PROMPT, params, "r")
    (offline,) = run(final)
    core = engine(model_path, OutputMode.DELTA)
    core.add_request(PROMPT, params, "r")
    tokens: dict[int, list[int]] = {0: [], 1: []}
    finish: dict[int, str | None] = {}
    deltas = run(core)
    assert all(isinstance(d, RequestDelta) for d in deltas) and deltas[-1].finished
    for delta in deltas:
        for sd in delta.seqs:
            tokens[sd.index] += sd.token_ids
            assert sd.logprobs is not None and len(sd.logprobs) == len(sd.token_ids)
            finish[sd.index] = sd.finish_reason or finish.get(sd.index)
    # no stop strings in the core: it runs to max_tokens (the offline output may stop early)
    for c in offline.outputs:
        assert tokens[c.index][: len(c.token_ids)] == c.token_ids
        assert len(tokens[c.index]) == 12 and finish[c.index] == "length"


def test_stop_sequences_finishes_a_child_then_the_prompt(model_path):
    core = engine(model_path, OutputMode.DELTA)
    core.add_request(PROMPT, SamplingParams(n=2, max_tokens=50, ignore_eos=True), "r")
    core.step()
    core.stop_sequences(["r#0"])
    assert core.is_unfinished("r")
    core.step()
    core.stop_sequences(["r#1", "unknown"])
    assert not core.is_unfinished("r") and not core.has_unfinished_requests()
    assert core.kv_manager.num_reclaimable_blocks == core.kv_manager.num_blocks


def test_to_delta_of_one_and_of_two_sequences():
    """A prompt's delta: the tokens since the last one, the finish once, nothing when no news
    (n == 1 builds it apart from n > 1: both must say the same)."""
    from phloem.core.request import Request, RequestStatus
    from phloem.engine.prompt_entry import PromptEntry, SequenceEntry
    from phloem.outputs import RequestMetrics

    def entry(rid: str, n: int) -> PromptEntry:
        seqs = [SequenceEntry(Request(f"{rid}#{i}", PROMPT, SamplingParams()), i, rid, None)
                for i in range(n)]  # fmt: skip
        for i, seq in enumerate(seqs):
            seq.request.status, seq.request.num_cached_tokens = RequestStatus.RUNNING, 4 * i + 4
        return PromptEntry(rid, None, PROMPT, seqs, RequestMetrics(0.0))

    one, two = entry("a", 1), entry("b", 2)
    for e in (one, two):
        for seq in e.sequences:
            seq.request.output_token_ids += [7, 8]
    assert one.to_delta() == RequestDelta("a", [SeqDelta(0, [7, 8])], False, 4)
    assert two.to_delta() == RequestDelta(
        "b", [SeqDelta(0, [7, 8]), SeqDelta(1, [7, 8])], False, 12
    )
    assert one.to_delta() == RequestDelta("a", [], False, 4)  # no news
    two.sequences[1].request.output_token_ids.append(9)
    for e in (one, two):
        e.sequences[-1].request.status = RequestStatus.FINISHED_LENGTH
    one.finished = True
    assert one.to_delta() == RequestDelta("a", [SeqDelta(0, [], finish_reason="length")], True, 4)
    assert two.to_delta() == RequestDelta("b", [SeqDelta(1, [9], None, None, "length")], False, 12)
    assert one.to_delta().seqs == [] and two.to_delta().seqs == []  # the finish is sent once


def test_started_forgets_a_request_whose_wasted_row_comes_after_its_finish():
    """Async scheduling: a request stopping on EOS in step N is scheduled once more in N + 1
    (a wasted row); its finish goes out with N, and N + 1's observer must not count it as
    started again (it would stay in `counts.started` for good)."""
    from phloem.core.scheduler_output import NewSequenceData, ScheduledSequence

    counters = SimpleNamespace(num_running=0, num_waiting=0, num_reclaimable_blocks=0,
        num_blocks=0, num_prefix_cache_queries=0, num_prefix_cache_hits=0,
        num_computed_prompt_tokens=0, num_reused_prompt_tokens=0)  # fmt: skip
    engine = SimpleNamespace(add_step_observer=lambda fn: None, scheduler=counters,
                             kv_manager=counters, drafter=None)  # fmt: skip
    core = EngineCore(engine, None, SimpleNamespace(send=lambda data, copy=True: None))

    def observe(*rows: ScheduledSequence) -> None:
        core._observe_step(SimpleNamespace(scheduler_output=SchedulerOutput(list(rows))))

    new = NewSequenceData(PROMPT, [], SamplingParams())
    observe(ScheduledSequence("r", 0, 8, True, new_sequence=new))  # admitted: started
    observe(ScheduledSequence("r", 8, 1, True))
    assert core.counts.started == {"r"}
    core._send([RequestDelta("r", [SeqDelta(0, [2], finish_reason="stop")], True)])
    observe(ScheduledSequence("r", 9, 1, True))  # the wasted row, collected after the finish
    assert core.counts.started == set()


def test_messages_round_trip():
    params = SamplingParams(n=2, stop=["x"], seed=3, logprobs=2)
    encoder = msgspec.msgpack.Encoder()
    request = CoreRequest("r", [1, 2], params_to_dict(params), 1.5)
    decoded = core_decoder().decode(encoder.encode(request))
    assert decoded == request
    assert SamplingParams.from_dict(decoded.sampling_params) == params
    abort = CoreAbort(["a"], ["b#1"])
    assert core_decoder().decode(encoder.encode(abort)) == abort
    step = CoreStep(
        [RequestDelta("r", [SeqDelta(0, [5], [{5: -0.5}], -0.5, "stop", 7)], True, 4)],
        CoreStats(1, 2, 3, 4, 5, 6, 7, 8, 9),
    )
    assert front_decoder().decode(encoder.encode(step)) == step


class HeldDevice(UniProcExecutor):
    """Steps stay on the "device" until the test sets `free`; `admitted[k]`: the request ids
    step k admitted."""

    def __init__(self, worker) -> None:
        super().__init__(worker)
        self.admitted: list[list[str]] = []
        self.num_collected = 0
        self.free = threading.Event()

    def launch(self, scheduler_output):
        if not scheduler_output.is_empty:
            self.admitted.append(
                [s.seq_id for s in scheduler_output.scheduled if s.new_sequence is not None]
            )
        return super().launch(scheduler_output)

    def collect(self, launched):
        assert self.free.wait(30)
        self.num_collected += 1
        return super().collect(launched)


class WaitForNews(StepPacing):
    """While `hold`, the core waits for a message before building the next step; `asked` is
    set once it does."""

    def __init__(self) -> None:
        super().__init__()
        self.hold, self.asked = True, threading.Event()

    def deadline(self, in_flight) -> float:
        if not self.hold:
            return 0.0
        self.asked.set()
        return time.monotonic() + 30.0


def test_a_request_arriving_while_step_n_runs_is_in_step_n_plus_1(model_path):
    args = EngineArgs(str(model_path), block_size=4, max_num_batched_tokens=32)
    core_engine = LLMEngine(
        args.create_engine_config(), executor_factory=HeldDevice, output_mode=OutputMode.DELTA
    )
    assert core_engine.scheduler_config.async_scheduling
    device: HeldDevice = core_engine.executor  # type: ignore[assignment]
    context = zmq.Context()
    to_core, from_core = context.socket(zmq.PUSH), context.socket(zmq.PULL)
    to_core.bind("inproc://in")
    from_core.bind("inproc://out")
    core_in, core_out = context.socket(zmq.PULL), context.socket(zmq.PUSH)
    core_in.connect("inproc://in")
    core_out.connect("inproc://out")
    pacing = WaitForNews()
    thread = threading.Thread(target=EngineCore(core_engine, core_in, core_out, pacing).run)
    thread.start()
    encoder = msgspec.msgpack.Encoder()
    params = params_to_dict(SamplingParams(max_tokens=4, ignore_eos=True))
    try:
        to_core.send(encoder.encode(CoreRequest("a", PROMPT, params, 0.0)))
        # step 0 (a's prompt) is on the device; the core either waits for news (the fix) or
        # has built step 1 already (building it at once: b could only start in step 2)
        deadline = time.monotonic() + 30
        while not pacing.asked.is_set() and len(device.admitted) < 2:
            assert time.monotonic() < deadline
            time.sleep(0.001)
        in_flight = device.num_collected  # the oldest step launched and not collected
        pacing.hold = False
        to_core.send(encoder.encode(CoreRequest("b", PROMPT[::-1], params, 0.0)))
        device.free.set()
        finished: set[str] = set()
        while finished != {"a", "b"}:
            assert from_core.poll(30_000)
            step = front_decoder().decode(from_core.recv())
            finished |= {d.request_id for d in step.deltas if d.finished}
    finally:
        device.free.set()
        to_core.send(encoder.encode(CoreShutdown()))
        thread.join(30)
        context.destroy(linger=0)
    first = next(k for k, ids in enumerate(device.admitted) if "b" in ids)
    assert (in_flight, first) == (0, 1)


def test_pacing_waits_only_after_unhurried_steps_of_the_in_flight_shape():
    def step(tokens: list[int]) -> SchedulerOutput:
        return SchedulerOutput(scheduled=[SimpleNamespace(num_tokens=n) for n in tokens])

    def collected(pacing: StepPacing, sched: SchedulerOutput, wait_s: float) -> None:
        pacing.returned(time.monotonic() - 1.0)  # the step kept the device a second longer
        pacing.observe(StepRecord(0, sched, None, 1e-4, 1e-4, wait_s, 0.0))

    pacing, decode, mixed = StepPacing(), step([1] * 8), step([1] * 8 + [512])
    pacing.drained(1e-4)
    collected(pacing, decode, 0.5)
    pacing.returned(now := time.monotonic())
    assert pacing.deadline(decode) == 0.0  # one sample of the shape: no waiting yet
    collected(pacing, decode, 0.5)
    pacing.returned(now := time.monotonic())
    assert pacing.deadline(decode) > now  # two unhurried samples: wait for news
    assert pacing.deadline(step([1] * 4)) == 0.0  # a smaller shape: none measured
    assert pacing.deadline(mixed) > now  # more work than the measured decode: at least as long
    mixed.structured_seq_ids = ["x"]
    collected(pacing, mixed, 0.5)
    collected(pacing, mixed, 0.5)
    assert pacing.deadline(mixed) == 0.0  # its sampling waits for the next step(): never
    collected(pacing, decode, 0.0)  # the host was behind: this shape waits no more
    pacing.returned(now := time.monotonic())
    assert pacing.deadline(decode) < now
    for _ in range(64):  # the unhurried decode samples age out behind other shapes' steps
        collected(pacing, mixed, 0.5)
    collected(pacing, decode, 0.5)
    pacing.returned(now := time.monotonic())
    assert pacing.deadline(decode) == 0.0
    collected(pacing, decode, 0.5)
    pacing.returned(now := time.monotonic())
    assert pacing.deadline(decode) > now
    pacing.returned(None)  # out of requests: all samples go
    collected(pacing, decode, 0.5)
    pacing.returned(now := time.monotonic())
    assert pacing.deadline(decode) == 0.0
    off = StepPacing(enabled=False)  # PHLOEM_LATE_DRAIN=0
    collected(off, decode, 0.5)
    collected(off, decode, 0.5)
    assert off.deadline(decode) == 0.0
