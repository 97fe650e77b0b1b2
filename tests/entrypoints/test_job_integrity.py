"""Integrity of the batch jobs `phloem generate` and `phloem run-batch` (issue 23).

Paths are checked before the model loads; a second job on the same output refuses at once; a
rerun whose input lines or output-changing options differ from the saved results' refuses,
naming what changed (or recomputes the changed lines with `--recompute-changed`); an interrupt
or a full disk ends a job with one line saying what is saved, and a rerun finishes it.

Jobs run in-process through `cli.main` on a tiny random-weight model; the interrupt and the
file-size limit need their own process.
"""

from __future__ import annotations

import json
import os
import re
import resource
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from phloem.entrypoints import cli
from phloem.entrypoints.job_guard import (
    EXIT_LOCKED,
    EXIT_NO_SPACE,
    EXIT_USAGE,
    Fingerprint,
    JobError,
    JobProgress,
    OutputLock,
    job_options,
    line_digest,
)
from phloem.entrypoints.resumable import ResultLog
from tests.engine.tiny_models import tiny_model_dir

ENGINE = ["--max-model-len", "128", "--num-gpu-blocks", "64", "--no-progress"]


@pytest.fixture(scope="module")
def model(tmp_path_factory, embedded_tokenizer_dir) -> str:
    return str(tiny_model_dir(tmp_path_factory, embedded_tokenizer_dir, "llama", "jobs", 3))


def generate_lines(num: int, max_tokens: int = 3) -> list[str]:
    return [
        json.dumps({"id": f"g{i}", "prompt": f"count to {i}:", "max_tokens": max_tokens,
                    "temperature": 0, "ignore_eos": True})
        for i in range(num)
    ]  # fmt: skip


def batch_lines(num: int, max_tokens: int = 3) -> list[str]:
    return [
        json.dumps({"custom_id": f"c{i}", "method": "POST", "url": "/v1/completions",
                    "body": {"prompt": f"count to {i}:", "max_tokens": max_tokens,
                             "temperature": 0, "ignore_eos": True}})
        for i in range(num)
    ]  # fmt: skip


def job_argv(command: str, src: Path, out: Path, model: str, *extra: str) -> list[str]:
    return [command, "-i", str(src), "-o", str(out), "--model", model, *ENGINE, *extra]


def run(argv: list[str], capsys) -> tuple[int, str]:
    capsys.readouterr()
    code = cli.main(argv)
    return code, capsys.readouterr().err


def one_line_error(err: str) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert "Traceback" not in err
    return lines[0]


def tree(path: Path) -> dict[str, bytes | None]:
    return {
        str(p.relative_to(path)): (p.read_bytes() if p.is_file() else None)
        for p in sorted(path.rglob("*"))
    }


def records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


# -- paths, before the model loads -------------------------------------------------------------


PATH_CASES = {
    "missing input": (lambda t: (t / "nope.jsonl", t / "out.jsonl"), "cannot read input"),
    "input is a directory": (lambda t: (t / "d", t / "out.jsonl"), "not a JSONL file"),
    "output directory missing": (
        lambda t: (t / "in.jsonl", t / "no" / "o.jsonl"),
        "the directory of output",
    ),
    "output is a directory": (lambda t: (t / "in.jsonl", t / "d"), "name a file in it"),
    "output is the input": (lambda t: (t / "in.jsonl", t / "d" / ".." / "in.jsonl"), "the input"),
}


@pytest.mark.parametrize("command", ["generate", "run-batch"])
@pytest.mark.parametrize("case", sorted(PATH_CASES))
def test_bad_paths_refused_before_the_model_loads(tmp_path, capsys, command, case):
    """A model path that does not exist proves the paths are checked first: the error names the
    path problem, exit code 2, and nothing in the folder is created or changed."""
    paths, expected = PATH_CASES[case]
    (tmp_path / "d").mkdir()
    (tmp_path / "in.jsonl").write_text("\n".join(generate_lines(2)) + "\n")
    src, out = paths(tmp_path)
    before = tree(tmp_path)
    code, err = run(job_argv(command, src, out, str(tmp_path / "no-model")), capsys)
    assert code == EXIT_USAGE
    assert expected in one_line_error(err)
    assert tree(tmp_path) == before


def test_generate_summary_json_path_checked_first(tmp_path, capsys):
    src = tmp_path / "in.jsonl"
    src.write_text("\n".join(generate_lines(2)) + "\n")
    argv = job_argv("generate", src, tmp_path / "out.jsonl", str(tmp_path / "no-model"))
    code, err = run([*argv, "--summary-json", str(tmp_path / "no" / "s.json")], capsys)
    assert code == EXIT_USAGE and "the directory of output" in one_line_error(err)
    assert sorted(os.listdir(tmp_path)) == ["in.jsonl"]


# -- the output lock ---------------------------------------------------------------------------


@pytest.mark.parametrize("command", ["generate", "run-batch"])
def test_second_job_on_the_same_output_refuses_at_once(tmp_path, capsys, model, command):
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("\n".join(batch_lines(2) if command == "run-batch" else generate_lines(2)))
    with OutputLock(str(out)):  # the first job, running
        start = time.monotonic()
        code, err = run(job_argv(command, src, out, model), capsys)
        assert code == EXIT_LOCKED
        line = one_line_error(err)
        assert f"pid {os.getpid()}" in line and str(out) in line
        assert time.monotonic() - start < 5, "it must not wait for the lock or load the model"
        assert sorted(os.listdir(tmp_path)) == ["in.jsonl", "out.jsonl.lock"]
    assert sorted(os.listdir(tmp_path)) == ["in.jsonl"]  # released and removed
    code, err = run(job_argv(command, src, out, model), capsys)
    assert code == 0, err
    assert len(records(out)) == 2 and not Path(str(out) + ".lock").exists()


def test_lock_is_taken_again_after_its_file_was_removed(tmp_path):
    out = str(tmp_path / "out.jsonl")
    with OutputLock(out):
        with pytest.raises(JobError):
            OutputLock(out).acquire()
    second = OutputLock(out)
    second.acquire()  # the first removed its lock file on release
    with pytest.raises(JobError) as e:
        OutputLock(out).acquire()
    assert e.value.exit_code == EXIT_LOCKED
    second.release()


# -- the fingerprint -----------------------------------------------------------------------------


def test_run_batch_resume_refuses_changed_lines_and_options(tmp_path, capsys, model):
    src, out = tmp_path / "requests.jsonl", tmp_path / "results.jsonl"
    lines = batch_lines(5)
    src.write_text("\n".join(lines) + "\n")
    argv = job_argv("run-batch", src, out, model)
    code, err = run(argv, capsys)
    assert code == 0, err
    first = out.read_bytes()
    code, err = run(argv, capsys)  # the same job again: nothing to do
    assert code == 0 and "5 already done" in err and out.read_bytes() == first

    lines[2] = batch_lines(5, max_tokens=6)[2]  # line 3 edited after its answer was saved
    src.write_text("\n".join(lines) + "\n")
    code, err = run(argv, capsys)
    assert code == EXIT_USAGE
    line = one_line_error(err)
    assert "line 3" in line and "--recompute-changed" in line
    assert out.read_bytes() == first
    for flag, value in [("--seed", "7"), ("--load-format", "dummy"), ("--served-model-name", "x")]:
        code, err = run([*argv, flag, value], capsys)
        assert code == EXIT_USAGE and f"{flag} changed" in one_line_error(err)
        assert out.read_bytes() == first

    code, err = run([*argv, "--recompute-changed"], capsys)
    assert code == 0, err
    before = {r["custom_id"]: r for r in map(json.loads, first.decode().splitlines())}
    after = {r["custom_id"]: r for r in records(out)}
    assert len(records(out)) == 5 and sorted(after) == [f"c{i}" for i in range(5)]
    assert after["c2"]["response"]["body"]["usage"]["completion_tokens"] == 6
    assert all(after[c] == before[c] for c in after if c != "c2")
    code, err = run(argv, capsys)  # the fingerprint now holds the edited input
    assert code == 0 and "5 already done" in err


def test_run_batch_never_rewrites_another_jobs_results(tmp_path, capsys, model):
    src, out = tmp_path / "requests.jsonl", tmp_path / "results.jsonl"
    src.write_text("\n".join(batch_lines(3)) + "\n")
    foreign = b'{"id": "batch_req_1", "custom_id": "other", "response": {}}\n{"x": 1}\n'
    out.write_bytes(foreign)  # another job's results, which phloem never fingerprinted
    code, err = run(job_argv("run-batch", src, out, model), capsys)
    assert code == EXIT_USAGE and "choose another --output" in one_line_error(err)
    assert out.read_bytes() == foreign
    assert sorted(os.listdir(tmp_path)) == ["requests.jsonl", "results.jsonl"]


def test_run_batch_refuses_a_prompt_too_long_to_fit_before_tokenizing(tmp_path, capsys, model):
    """run-batch applies the server's character bound: a prompt longer than any prompt that
    fits in max_model_len tokens fails its line (without being tokenized); the others run."""
    from phloem.entrypoints.openai.limits import max_prompt_chars
    from phloem.models.loader import load_tokenizer, resolve_model

    bound = max_prompt_chars(load_tokenizer(resolve_model(model)), 128)
    lines = batch_lines(2)
    huge = json.loads(lines[1])
    huge["body"]["prompt"] = "a" * (bound + 1)
    lines[1] = json.dumps(huge)
    src, out = tmp_path / "requests.jsonl", tmp_path / "results.jsonl"
    src.write_text("\n".join(lines) + "\n")
    code, err = run(job_argv("run-batch", src, out, model), capsys)
    assert code == 0, err
    by_id = {r["custom_id"]: r for r in records(out)}
    assert by_id["c0"]["response"]["status_code"] == 200
    error = by_id["c1"]["response"]["body"]["error"]
    assert by_id["c1"]["response"]["status_code"] == 400
    assert error["param"] == "prompt" and f"more than {bound} characters" in error["message"]


def test_model_files_changed_in_place_count_as_another_model(tmp_path, model):
    copy = tmp_path / "model"
    shutil.copytree(model, copy)
    args = cli.build_parser().parse_args(["run-batch", "-i", "x", "-o", "y", "--model", str(copy)])
    before = job_options(args)
    weights = next(copy.glob("*.safetensors"))
    os.utime(weights, ns=(weights.stat().st_atime_ns, weights.stat().st_mtime_ns + 10**9))
    saved = {"options": before, "lines": {"1": line_digest("x")}}
    with pytest.raises(JobError) as e:
        Fingerprint("fp", job_options(args), {1: "x"}).stale_keys(saved, "out", False)
    assert f"the files of --model {copy} changed" in str(e.value)
    moved = tmp_path / "moved"
    copy.rename(moved)
    args.model = str(moved)
    stale = Fingerprint("fp", job_options(args), {1: "x"}).stale_keys(saved, "out", True)
    assert stale == {"1"}  # every line is recomputed under another model


# -- interrupts and full disks ------------------------------------------------------------------


def subprocess_cmd(command: str, src: Path, out: Path, model: str, *extra: str) -> list[str]:
    return [sys.executable, "-m", "phloem.entrypoints.cli", *job_argv(command, src, out, model),
            *extra]  # fmt: skip


@pytest.mark.parametrize(
    "command, sig, exit_code, word",
    [
        ("generate", signal.SIGINT, 130, "interrupted"),
        ("run-batch", signal.SIGINT, 130, "interrupted"),
        ("generate", signal.SIGTERM, 143, "terminated"),
    ],
)
def test_interrupt_saves_and_says_how_to_finish(
    tmp_path, capsys, model, command, sig, exit_code, word
):
    """SIGINT (or SIGTERM) mid-job: exit 130 (143) and one line naming how many lines are saved
    where; then a rerun with other options refuses, and one with an edited saved line recomputes
    just that line."""
    num = 24
    lines = generate_lines(num, 40) if command == "generate" else batch_lines(num, 40)
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    saved_in = Path(str(out) + ".partial") if command == "generate" else out
    src.write_text("\n".join(lines) + "\n")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = subprocess_cmd(command, src, out, model, "--max-num-seqs", "1")
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, env=env)
    deadline = time.monotonic() + 120
    while not saved_in.exists() or saved_in.read_bytes().count(b"\n") < 2:
        assert proc.poll() is None, proc.stderr.read()[-3000:]
        assert time.monotonic() < deadline, "no result appeared"
        time.sleep(0.01)
    code, err = run(job_argv(command, src, out, model), capsys)  # a second process
    assert code == EXIT_LOCKED and f"pid {proc.pid}" in one_line_error(err)
    proc.send_signal(sig)
    err = proc.communicate(timeout=60)[1]
    assert proc.returncode == exit_code, err[-3000:]
    assert "Traceback" not in err
    last = err.strip().splitlines()[-1]
    num_saved = saved_in.read_bytes().count(b"\n")
    assert 2 <= num_saved < num, "interrupted after the end"
    assert last == (
        f"error: {word}: {num_saved} of {num} lines saved in {saved_in}; "
        "rerun the same command to finish"
    )
    assert not Path(str(out) + ".lock").exists()
    saved = records(saved_in)

    argv = job_argv(command, src, out, model)
    code, err = run([*argv, "--dtype", "bfloat16"], capsys)
    assert code == EXIT_USAGE and "--dtype changed" in one_line_error(err)
    assert records(saved_in) == saved

    if command == "generate":
        edited = saved[0]["line"]
        lines[edited - 1] = generate_lines(num, 5)[edited - 1]
    else:
        edited = int(saved[0]["id"].removeprefix("batch_req_"))
        lines[edited - 1] = batch_lines(num, 5)[edited - 1]
    src.write_text("\n".join(lines) + "\n")
    code, err = run(argv, capsys)
    assert code == EXIT_USAGE and f"line {edited}" in one_line_error(err)
    code, err = run([*argv, "--recompute-changed"], capsys)  # any --max-num-seqs will do
    assert code == 0, err
    final = records(out)
    assert len(final) == num
    if command == "generate":
        assert [r["id"] for r in final] == [f"g{i}" for i in range(num)]
        tokens = [r["num_output_tokens"] for r in final]
        kept = {r["record"]["id"]: r["record"] for r in saved[1:]}
        assert all(r == kept[r["id"]] for r in final if r["id"] in kept)
        assert not saved_in.exists() and not Path(str(out) + ".job.json").exists()
    else:
        final.sort(key=lambda r: int(r["id"].removeprefix("batch_req_")))
        tokens = [r["response"]["body"]["usage"]["completion_tokens"] for r in final]
        kept = {r["id"]: r for r in saved[1:]}
        assert all(r == kept[r["id"]] for r in final if r["id"] in kept)
    assert tokens == [5 if n == edited else 40 for n in range(1, num + 1)]


def test_full_disk_becomes_one_line_with_what_is_saved(tmp_path):
    progress = JobProgress("/dev/full", 5)
    with pytest.raises(JobError) as e, progress:
        log = ResultLog("/dev/full", key_of=lambda r: r["k"])  # every write: ENOSPC
        log.append({"k": 0})
    assert e.value.exit_code == EXIT_NO_SPACE
    assert str(e.value) == (
        "No space left on device: 0 of 5 lines saved in /dev/full; free space and rerun the "
        "same command to finish"
    )


def test_file_size_limit_mid_job_then_rerun_finishes(tmp_path, model):
    """A write that fails for room (here a file size limit: EFBIG) ends the job with exit 74 and
    one line; a rerun with room finishes it with one line per input line."""
    num = 30
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("\n".join(generate_lines(num)) + "\n")
    cmd = subprocess_cmd("generate", src, out, model)

    def limit_file_size():  # in the child only; Python ignores SIGXFSZ, so writes fail
        resource.setrlimit(resource.RLIMIT_FSIZE, (3000, resource.RLIM_INFINITY))

    first = subprocess.run(
        cmd, capture_output=True, text=True, timeout=120, preexec_fn=limit_file_size
    )
    assert first.returncode == EXIT_NO_SPACE, first.stderr[-3000:]
    assert "Traceback" not in first.stderr
    match = re.fullmatch(
        r"error: File too large: (\d+) of 30 lines saved in (\S+); free space and rerun the "
        r"same command to finish",
        first.stderr.strip().splitlines()[-1],
    )
    assert match and match[2] == f"{out}.partial", first.stderr[-3000:]
    assert 0 < int(match[1]) < num
    rerun = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert [r["id"] for r in records(out)] == [f"g{i}" for i in range(num)]
    assert sorted(os.listdir(tmp_path)) == ["in.jsonl", "out.jsonl"]


def test_exit_codes_help_names_every_exit_code():
    """`--help` of the jobs lists every exit code they use (the job_guard and generate ones)."""
    import re

    from phloem.entrypoints import generate, job_guard

    codes = {
        value
        for module in (job_guard, generate)
        for name, value in vars(module).items()
        if name.startswith("EXIT_") and isinstance(value, int)
    }
    listed = {int(c) for c in re.findall(r"(?:^|[;,] )(\d+) ", job_guard.EXIT_CODES_HELP)}
    listed |= {int(c) for c in re.findall(r"codes: (\d+) ", job_guard.EXIT_CODES_HELP)}
    assert codes - {0} <= listed, sorted(codes - listed)
