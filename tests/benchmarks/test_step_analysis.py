"""The step trace and its analysis (phloem.bench.step_trace_file, step_analysis, `phloem bench
step-trace`, serve-summary's step tables): step counts by kind, durations under async scheduling
and after idle, the least-squares cost fit recovering known coefficients, buffered writing, and
several server configurations compared with one baseline."""

from __future__ import annotations

import json
import random

import pytest

from phloem.bench.step_analysis import analyze, fit_step_time, in_window, with_durations
from phloem.bench.step_trace_file import StepTraceFile, read_step_trace, step_counts
from phloem.core.scheduler_output import NewSequenceData, ScheduledSequence, SchedulerOutput
from phloem.engine.step_observer import StepRecord
from phloem.entrypoints.bench_serve_summary import markdown, summarize_dir
from phloem.entrypoints.cli import main
from phloem.sampling_params import SamplingParams

# known costs [ms]: a + b * tokens + c * decode_seqs per kind
COSTS = {"decode": (2.0, 0.010, 0.0), "mixed": (3.0, 0.002, 0.020), "prefill": (1.0, 0.003, 0.0)}


def _step(i: int, decode: int, prefill: int, chunks: int) -> dict:
    return {"step": i, "seqs": decode + chunks, "decode_seqs": decode, "prefill_tokens": prefill,
            "prefill_chunks": chunks, "tokens": decode + prefill, "shared_seqs": 0,
            "graph": chunks == 0, "schedule_ms": 0.1, "launch_ms": 0.4, "wait_ms": 1.0,
            "update_ms": 0.2}  # fmt: skip


def synthetic_trace(seed: int = 0) -> list[dict]:
    """Steps of known duration, stamped as async scheduling does (step i is scheduled before
    step i-1 is collected), with one idle gap of 1 s before step 60 (no step in flight)."""
    rng = random.Random(seed)
    steps, t1 = [], 100.0
    for i in range(120):
        kind = ("decode", "mixed", "prefill")[i % 3]
        decode = 0 if kind == "prefill" else rng.randrange(1, 200)
        chunks = 0 if kind == "decode" else rng.randrange(1, 4)
        prefill = 0 if kind == "decode" else rng.randrange(16, 2048)
        step = _step(i, decode, prefill, chunks)
        a, b, c = COSTS[kind]
        duration = (a + b * step["tokens"] + c * decode) / 1e3
        if i in (0, 60):  # the first step, and one after 1 s idle: nothing in flight before
            step["t0"] = t1 + (1.0 if i else 0.0)
            step["t1"] = step["t0"] + duration
        else:  # scheduled while the previous step ran
            step["t0"] = t1 - 0.0004
            step["t1"] = t1 + duration
        t1 = step["t1"]
        steps.append(step)
    return steps


def test_fit_recovers_known_coefficients_per_kind():
    analysis = analyze(with_durations(synthetic_trace()))
    kinds = analysis["kinds"]
    assert {k: v["steps"] for k, v in kinds.items()} == {"decode": 40, "mixed": 40, "prefill": 40}
    mixed = kinds["mixed"]["fit"]
    assert mixed["a_ms"] == pytest.approx(3.0) and mixed["b_us_per_token"] == pytest.approx(2.0)
    assert mixed["c_us_per_seq"] == pytest.approx(20.0) and mixed["rms_ms"] < 1e-9
    # decode steps: tokens == decode_seqs, so c is left out and b carries the per-sequence cost
    decode = kinds["decode"]["fit"]
    assert decode["c_us_per_seq"] is None
    assert decode["a_ms"] == pytest.approx(2.0) and decode["b_us_per_token"] == pytest.approx(10.0)
    prefill = kinds["prefill"]["fit"]  # no decodes: c left out
    assert prefill["c_us_per_seq"] is None and prefill["b_us_per_token"] == pytest.approx(3.0)
    assert prefill["a_ms"] == pytest.approx(1.0) and prefill["r2"] == pytest.approx(1.0)


def test_durations_shares_and_decode_weighted_time():
    steps = with_durations(synthetic_trace())
    durations = {s["step"]: s["dur"] for s in steps}
    for s in steps:  # the duration is the step's own cost, also after the idle gap
        a, b, c = COSTS[("decode", "mixed", "prefill")[s["step"] % 3]]
        expected = a + b * s["tokens"] + c * s["decode_seqs"]
        assert durations[s["step"]] * 1e3 == pytest.approx(expected)
    analysis = analyze(steps)
    busy = sum(durations.values())
    assert analysis["span_s"] == pytest.approx(steps[-1]["t1"] - steps[0]["t0"])
    assert analysis["busy_share"] == pytest.approx(busy / analysis["span_s"])
    shares = sum(k["wall_share"] for k in analysis["kinds"].values())
    assert shares == pytest.approx(analysis["busy_share"])
    weighted = sum(s["dur"] * s["decode_seqs"] for s in steps) / sum(
        s["decode_seqs"] for s in steps
    )
    assert analysis["decode_weighted_step_ms"] == pytest.approx(weighted * 1e3)
    parts = sum(k["decode_weighted_ms"] for k in analysis["kinds"].values())
    assert parts == pytest.approx(analysis["decode_weighted_step_ms"])
    assert analysis["kinds"]["prefill"]["decode_weighted_ms"] == 0.0
    assert analysis["kinds"]["decode"]["graph_share"] == 1.0
    window = in_window(steps, steps[10]["t1"], steps[19]["t1"])
    assert [s["step"] for s in window] == list(range(10, 20))


def test_fit_leaves_out_constant_columns_and_needs_enough_steps():
    fit = fit_step_time([5.0, 5.0, 5.0], [64, 64, 64], [8, 8, 8])
    assert fit["a_ms"] == pytest.approx(5.0)
    assert fit["b_us_per_token"] is None and fit["c_us_per_seq"] is None
    assert fit_step_time([1.0], [10], [1]) is None
    with pytest.raises(ValueError, match="no steps"):
        analyze([])


def _seq(seq_id: str, computed: int, tokens: int, **kw) -> ScheduledSequence:
    return ScheduledSequence(seq_id, computed, tokens, True, **kw)


def test_step_counts_split_prompt_chunks_from_decodes():
    new = NewSequenceData([1] * 9, [], SamplingParams())
    sched = SchedulerOutput([
        _seq("d", 40, 1),  # decode
        _seq("s", 40, 1, prefix_len=32, group_id=0),  # decode over a shared prefix
        _seq("v", 40, 3, draft_token_ids=(5, 6)),  # verifying two drafts: a decode
        _seq("c", 16, 16),  # a later prompt chunk
        _seq("h", 8, 1, new_sequence=new),  # admitted with all but one token cached: a chunk
    ])  # fmt: skip
    assert step_counts(sched) == (5, 3, 17, 2, 22, 1)
    # with what each sequence held when admitted, a later one-token chunk of its prompt counts
    # as a prompt chunk (it counted as a decode without); a departed sequence is forgotten
    known: dict[str, int] = {}
    step_counts(SchedulerOutput([_seq("p", 0, 8, new_sequence=new)]), known)
    assert known == {"p": 9}
    assert step_counts(SchedulerOutput([_seq("p", 8, 1)]), known) == (1, 0, 1, 1, 1, 0)
    assert step_counts(SchedulerOutput([_seq("p", 8, 1)])) == (1, 1, 0, 0, 1, 0)
    assert step_counts(SchedulerOutput([_seq("p", 9, 1)]), known) == (1, 1, 0, 0, 1, 0)
    step_counts(SchedulerOutput([], finished_seq_ids=["p"]), known)
    assert known == {}


def _record(index: int, sched: SchedulerOutput) -> StepRecord:
    return StepRecord(index, sched, None, 0.001, 0.002, 0.003, 0.0005, launched_at=50.0)


def test_trace_file_buffers_lines_and_reads_back(tmp_path):
    path = tmp_path / "t.jsonl"
    trace = StepTraceFile(path, {"max_num_seqs": 4}, cuda_graphs=True, max_graph_seqs=4,
                          flush_every=3)  # fmt: skip
    decode = SchedulerOutput([_seq(f"r{i}", 9, 1) for i in range(4)])
    too_big = SchedulerOutput([_seq(f"r{i}", 9, 1) for i in range(5)])
    mixed = SchedulerOutput([_seq("r0", 9, 1), _seq("p", 0, 30)])
    trace(_record(0, decode))
    trace(_record(1, too_big))
    assert len(path.read_text().splitlines()) == 1  # the header only: lines are buffered
    trace(_record(2, mixed))
    assert len(path.read_text().splitlines()) == 4
    trace(_record(3, decode))
    trace(_record(4, SchedulerOutput([_seq("v", 9, 3, draft_token_ids=(1, 2))])))  # verify
    trace.close()
    with open(path, "a") as f:
        f.write('{"step": 5, "t0": 1')  # a writer killed mid-line
    header, steps = read_step_trace(path)
    assert header["trace"] == "phloem-steps" and header["max_num_seqs"] == 4
    assert [s["graph"] for s in steps] == [True, False, False, True, False]
    # with piecewise graphs up to 32 tokens, every other step of at most 32 tokens replays them
    trace = StepTraceFile(tmp_path / "p.jsonl", {}, cuda_graphs=True, max_graph_seqs=4,
                          flush_every=1, max_piece_tokens=32)  # fmt: skip
    big = SchedulerOutput([_seq("r0", 9, 1), _seq("p", 0, 40)])
    for i, s in enumerate((decode, too_big, mixed, big)):
        trace(_record(i, s))
    trace.close()
    pieces = read_step_trace(tmp_path / "p.jsonl")[1]
    assert [s["graph"] for s in pieces] == [True, True, True, False]
    assert steps[2]["prefill_tokens"] == 30 and steps[2]["decode_seqs"] == 1
    assert steps[0]["t0"] == pytest.approx(50.0 - 0.003) and steps[0]["launch_ms"] == 2.0
    (tmp_path / "bad.jsonl").write_text('{"x": 1}\n')
    with pytest.raises(ValueError, match="not a phloem step trace"):
        read_step_trace(tmp_path / "bad.jsonl")


def _write_trace(path, steps: list[dict], created: str = "2026-01-01T00:00:00+0000") -> None:
    header = {"trace": "phloem-steps", "version": 1, "created": created}
    lines = [json.dumps(header)] + [json.dumps({k: v for k, v in s.items() if k != "dur"})
                                    for s in steps]  # fmt: skip
    path.write_text("\n".join(lines) + "\n")


def test_cli_prints_tables_and_writes_json(tmp_path, capsys):
    steps = synthetic_trace()
    _write_trace(tmp_path / "a.jsonl", steps)
    run = tmp_path / "run.json"
    run.write_text(json.dumps({"window_monotonic_s": [steps[0]["t0"], steps[59]["t1"]]}))
    out = tmp_path / "out.json"
    assert main(["bench", "step-trace", str(tmp_path / "a.jsonl"), "--run", str(run),
                 "--json", str(out)]) == 0  # fmt: skip
    printed = capsys.readouterr().out
    assert "| mixed | 20 |" in printed and "decode-weighted step time" in printed
    assert json.loads(out.read_text())[str(tmp_path / "a.jsonl")]["steps"] == 60
    run.write_text("{}")
    assert main(["bench", "step-trace", str(tmp_path / "a.jsonl"), "--run", str(run)]) == 2
    assert "window_monotonic_s" in capsys.readouterr().err


def _run(engine: str, workload: str, rps: float, window: list[float]) -> dict:
    def stats(p50: float) -> dict:
        return {"mean": p50, "median": p50, "p90": p50, "p99": p50 * 2}

    return {"engine": engine, "workload": workload, "request_rate": 30, "completed": 10,
            "failed": 0, "request_throughput": rps, "output_throughput": rps * 128,
            "ttft_ms": stats(80.0), "tpot_ms": stats(10.0), "itl_ms": stats(6.0),
            "window_monotonic_s": window, "date": "2026-01-01T01:00:00+0000"}  # fmt: skip


def test_summary_compares_each_configuration_and_reads_its_trace(tmp_path):
    steps = synthetic_trace()
    window = [steps[0]["t0"], steps[-1]["t1"]]
    runs = [_run("vllm", "poisson-30", 25.0, window), _run("phloem@a", "poisson-30", 20.0, window),
            _run("phloem@b", "poisson-30", 30.0, window)]  # fmt: skip
    for r in runs:
        (tmp_path / f"{r['engine']}-{r['workload']}.json").write_text(json.dumps(r))
    _write_trace(tmp_path / "phloem@b-steps.jsonl", steps)
    # a trace started after the run (another server start) is not the run's
    _write_trace(tmp_path / "phloem@b-steps-2.jsonl", steps[:10], "2026-01-01T02:00:00+0000")
    summary = summarize_dir(tmp_path, "phloem", "vllm", 300.0, 25.0)
    ratios = {r["engine"]: r["request_throughput"] for r in summary["ratios"]}
    assert ratios == {"phloem@a": 0.8, "phloem@b": 1.2}
    assert summary["goodput_ratios"] == {"phloem@a": 0.8, "phloem@b": 1.2}
    assert set(summary["steps"]) == {"phloem@b"}
    assert summary["steps"]["phloem@b"]["poisson-30"]["steps"] == 120
    text = markdown(summary)
    assert "| phloem@a | poisson-30 | 0.80 |" in text and "- phloem@b / vllm: 1.20" in text
    assert "| phloem@b | poisson-30 | mixed | 40 |" in text
    edges = summary["steps"]["phloem@b"]["poisson-30"]["edges"]
    assert edges["before_first_step_s"] == 0 and edges["after_last_step_s"] == 0
    assert edges["steps"] == 120 and edges["prefill_tokens"] == sum(
        s["prefill_tokens"] for s in steps
    )
    assert f"| phloem@b | poisson-30 | {window[1] - window[0]:.3f} | 0.000 |" in text
