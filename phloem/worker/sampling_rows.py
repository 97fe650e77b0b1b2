"""A step's sampling rows and their launch, each request failing alone (`worker.model_runner`).

A request whose own sampling setup (its generator, its row) or sampling raises is sampled as a
greedy placeholder row so the batch goes on, and its id lands in the step's `failed` map for the
engine to fail it after the step.
"""

from __future__ import annotations

import torch

from phloem.core.scheduler_output import SchedulerOutput
from phloem.layers.sampler import SampledTokens, Sampler, SamplingRow, seeded_generator
from phloem.ops.seeded_noise import SeedStream
from phloem.sampling_params import SamplingParams
from phloem.worker.input_batch import SequenceState, sampling_row

# the row sampled for a sequence whose own row failed: greedy, so it draws no randomness
_PLACEHOLDER_PARAMS = SamplingParams(temperature=0.0)

# a seeded sequence's randomness, kept until it finishes: its generator (the speculative
# verifier's) and its counter-based noise stream (the sampler's, `ops.seeded_noise`)
SeededRandomness = tuple[torch.Generator, SeedStream]


def placeholder_row(state: SequenceState) -> SamplingRow:
    """The row sampled for a sequence that failed alone: greedy, no bans, draws nothing."""
    return SamplingRow(_PLACEHOLDER_PARAMS, state.prompt_token_ids, [], generator=None)


def launch_sampler(
    sampler: Sampler,
    shared_generator: torch.Generator,
    logits: torch.Tensor,
    rows: list[SamplingRow],
    seq_ids: list[str],
    states: list[SequenceState],
    failed: dict[str, str],
    grammar: tuple[torch.Tensor, torch.Tensor] | None = None,
    noise: torch.Tensor | None = None,
) -> SampledTokens:
    """`sampler.launch(logits, rows, grammar, noise)`, failing alone each row whose sampling
    raises (the trials and the launch after them draw their own noise).

    When the batch raises, each row is tried alone (the others replaced by greedy placeholders,
    every generator's state, `shared_generator`'s too, and every seed stream's draw count
    restored after each trial, so the rows that go on draw what they would have, less anything
    the failed batch attempt drew); the rows that raise on their own are failed (added to
    `failed`) and replaced by placeholders for the real launch. A fault no single row causes, or one that survives the replacement, is the
    step's own: it propagates. Mutates `rows` and `failed` only on that path."""
    try:
        return sampler.launch(logits, rows, grammar, noise)
    except Exception:  # noqa: BLE001 - find out whether one sequence causes it
        placeholders = [placeholder_row(state) for state in states]
        generators = {id(g): g for g in [shared_generator] + [r.generator for r in rows]}
        saved = [(g, g.get_state()) for g in generators.values() if g is not None]
        streams = {id(r.seed_stream): r.seed_stream for r in rows if r.seed_stream is not None}
        saved_draws = [(stream, stream.draws) for stream in streams.values()]
        culprits: dict[int, str] = {}
        for i in range(len(rows)):
            trial = [*placeholders[:i], rows[i], *placeholders[i + 1 :]]
            try:
                sampler.launch(logits, trial, grammar)
            except Exception as e:  # noqa: BLE001 - row i's own fault
                culprits[i] = f"sampling failed: {type(e).__name__}: {e}"
            for generator, state in saved:
                generator.set_state(state)
            for stream, draws in saved_draws:
                stream.draws = draws
        if not culprits:
            raise
    for i, message in culprits.items():
        failed[seq_ids[i]] = message
        rows[i] = placeholders[i]
    return sampler.launch(logits, rows, grammar)


def sampling_rows(
    sched: SchedulerOutput,
    sampled: list[int],
    states: list[SequenceState],
    generators: dict[str, SeededRandomness],
    device: torch.device,
    eos_token_id: int | None,
) -> tuple[list[SamplingRow], dict[str, str]]:
    """The sampling rows of the step's sampled sequences (rows `sampled` of `sched`), and
    {seq id: reason} for those whose row could not be built: they get a greedy placeholder row
    (the batch goes on) and are failed by the engine after the step. `generators` holds the
    seeded sequences' generators and seed streams (made on first use, kept until the sequence
    finishes, across preemptions: a recomputed sequence's draws go on where they were)."""
    rows: list[SamplingRow] = []
    failed: dict[str, str] = {}
    for i in sampled:
        state = states[i]
        row = state.row  # cached when nothing in it depends on the step
        if row is None:
            s = sched.scheduled[i]
            try:
                num_tokens = s.num_computed_tokens + s.num_tokens
                row = _sampling_row(s.seq_id, state, num_tokens, generators, device, eos_token_id)
            except Exception as e:  # noqa: BLE001 - this sequence's fault: it fails alone
                failed[s.seq_id] = f"sampling setup failed: {type(e).__name__}: {e}"
                row = placeholder_row(state)
        rows.append(row)
    return rows, failed


def _sampling_row(
    seq_id: str,
    state: SequenceState,
    num_tokens: int,
    generators: dict[str, SeededRandomness],
    device: torch.device,
    eos_token_id: int | None,
) -> SamplingRow:
    """The row of a sequence that has `num_tokens` tokens once this step ran (its sample is
    output number num_tokens - prompt length); makes its generator and seed stream on first use
    (both seeded from `generator_seed()`)."""
    params = state.params
    generator, stream = None, None
    if params.seed is not None and not params.greedy:
        randomness = generators.get(seq_id)
        if randomness is None:
            seed = params.generator_seed()
            assert seed is not None
            randomness = (seeded_generator(seed, device), SeedStream(seed))
            generators[seq_id] = randomness
        generator, stream = randomness
    num_before = num_tokens - len(state.prompt_token_ids)
    return sampling_row(state, num_before, generator, eos_token_id, stream)
