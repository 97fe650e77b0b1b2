"""`phloem serve` on the CPU with the model replaced by a step-time model of a GPU: the server,
the engine core, its scheduler and prefix groups run for real, the forward pass does not.

Why: a burst's engine steps on an H200 produce ~25,000 tokens a second (800 streams, a decode
step every ~32 ms); a tiny model on a CPU cannot, so the server process and the benchmark client
are never loaded as they are on the GPU machine. Here each step "runs" for the time the model
below gives and samples a token per sampled sequence (ids cycling through ordinary vocabulary
entries, so detokenization does real work), as an asynchronous device would: `launch` returns at
once, `collect` waits until the step's modelled end.

    t_step = T0 + C_PREFILL * prompt tokens + C_DECODE * decoding sequences   [s]

The default constants are fitted by eye to the H200 step trace of Llama-3.1-8B in
benchmarks/results/2026-11-26d-h200-serving (the shared-prefix burst: mixed steps of 8,192
tokens ~197-210 ms, decode steps of 800 sequences ~32 ms): T0 2 ms, C_PREFILL 24 us,
C_DECODE 38 us. `PACED_STEP_MODEL="T0_ms,C_PREFILL_us,C_DECODE_us"` sets others.

Run from the repository root with `phloem serve`'s flags (a tiny random model: any config
directory with a tokenizer; `--load-format dummy`):

    python benchmarks/serving_paced.py --model DIR --load-format dummy --port 8000 \
        --max-num-seqs 1024 --max-num-batched-tokens 8192 --num-gpu-blocks 80000 \
        --step-trace steps.jsonl

then `phloem bench serve` against it. Timings are the model's plus whatever the host adds; the
server's and the client's CPU time per token are real.
"""

from __future__ import annotations

import logging
import os
import sys
import time

from phloem.engine.executor import UniProcExecutor
from phloem.worker.model_runner import ModelRunnerOutput

_LOW, _SPAN = 1000, 19000  # sampled ids cycle through [1000, 20000): ordinary tokens


def step_model() -> tuple[float, float, float]:
    """(T0 [s], C_PREFILL [s / prompt token], C_DECODE [s / decoding sequence]) from
    PACED_STEP_MODEL ("T0_ms,C_PREFILL_us,C_DECODE_us"; default the H200 fit above).

    Raises:
        ValueError: PACED_STEP_MODEL is not three non-negative numbers.
    """
    text = os.environ.get("PACED_STEP_MODEL", "2,24,38")
    try:
        t0, prefill, decode = (float(v) for v in text.split(","))
    except ValueError:
        raise ValueError(
            f"PACED_STEP_MODEL must be 'T0_ms,C_PREFILL_us,C_DECODE_us', got {text!r}"
        ) from None
    if min(t0, prefill, decode) < 0:
        raise ValueError(f"PACED_STEP_MODEL values must be >= 0, got {text!r}")
    return t0 * 1e-3, prefill * 1e-6, decode * 1e-6


class PacedExecutor(UniProcExecutor):
    """The in-process executor with the forward pass replaced by the step-time model: steps
    end one after another (a device runs one at a time), each at its modelled duration after
    the later of its launch and the previous step's end."""

    def __init__(self, worker) -> None:
        super().__init__(worker)
        self.t0, self.c_prefill, self.c_decode = step_model()
        self._device_free = 0.0  # time.monotonic() when the last launched step ends
        self._counts: dict[str, int] = {}  # seq id -> tokens sampled so far

    def launch(self, scheduler_output):
        scheduled = scheduler_output.scheduled
        if not scheduled:
            return None
        prefill = decode = 0
        for s in scheduled:
            if s.new_sequence is not None or s.num_tokens > 1:
                prefill += s.num_tokens
            else:
                decode += 1
        duration = self.t0 + self.c_prefill * prefill + self.c_decode * decode
        end = max(time.monotonic(), self._device_free) + duration
        self._device_free = end
        for seq_id in scheduler_output.finished_seq_ids:
            self._counts.pop(seq_id, None)
        return end, [s.seq_id for s in scheduled if s.sample]

    def collect(self, launched) -> ModelRunnerOutput:
        if launched is None:
            return ModelRunnerOutput()
        end, seq_ids = launched
        delay = end - time.monotonic()
        if delay > 0:
            time.sleep(delay)
        counts, tokens = self._counts, {}
        for seq_id in seq_ids:
            n = counts.get(seq_id, 0)
            counts[seq_id] = n + 1
            tokens[seq_id] = _LOW + (hash(seq_id) + 7919 * n) % _SPAN
        return ModelRunnerOutput(sampled_token_ids=tokens, logprobs=dict.fromkeys(tokens))

    def sample(self, launched, grammar) -> None:
        raise NotImplementedError("the paced executor serves no structured outputs")

    def needs_token_history(self, scheduler_output) -> bool:
        return False


def main(argv: list[str] | None = None) -> int:
    from phloem.entrypoints.cli import build_parser
    from phloem.entrypoints.serve import cmd_serve

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    step_model()  # a bad PACED_STEP_MODEL fails here, not in the engine core
    args = build_parser().parse_args(["serve", *(sys.argv[1:] if argv is None else argv)])
    # the engine core process imports the factory by name (this file's folder is on sys.path)
    return cmd_serve(args, executor_factory="serving_paced:PacedExecutor")


if __name__ == "__main__":
    sys.exit(main())
