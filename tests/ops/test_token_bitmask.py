"""`ops.token_bitmask`: the Triton kernel (interpreted on the CPU) and the CPU path mask exactly
the tokens a plain reference masks, on fresh random bitmasks, row subsets and vocabularies (not
a multiple of 32, wider and narrower than the bitmask, strided rows); rows not named are left
as they were; bad arguments raise; the kernel compiles for Hopper; the sampler's constrained
rows draw only allowed tokens on both of its paths without touching the caller's logits."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from phloem.layers.sampler import Sampler, SamplingRow
from phloem.ops.seeded_noise import SeedStream
from phloem.ops.token_bitmask import _apply_torch, apply_token_bitmask_
from phloem.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def tb(triton_kernels):
    """The kernel module; on the CPU, interpreted (tests/conftest.py sets TRITON_INTERPRET)."""
    return triton_kernels("phloem.ops.token_bitmask_triton", "_token_bitmask_kernel")


def device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def reference(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """A copy of logits, masked token by token from the bits read one at a time (numpy)."""
    out = logits.clone().cpu()
    words = bitmask.cpu().numpy().view(np.uint32)
    vocab = out.shape[1]
    for i, row in enumerate(rows.tolist()):
        for t in range(vocab):
            word = t // 32
            if word >= words.shape[1] or not (int(words[i, word]) >> (t % 32)) & 1:
                out[row, t] = float("-inf")
    return out


def random_case(batch: int, vocab: int, width: int, num_rows: int, dtype, seed: int):
    """Fresh logits [batch, vocab], a bitmask int32 [num_rows, width] of random bits (~1/2
    allowed, some rows all zeros or all ones), distinct random rows [num_rows]."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(batch, vocab, generator=g).to(dtype)
    bitmask = torch.randint(-(2**31), 2**31 - 1, (num_rows, width), dtype=torch.int32, generator=g)
    if num_rows > 2:
        bitmask[0] = 0  # nothing allowed (the manager never sends it; the kernel must not care)
        bitmask[1] = -1  # everything
    rows = torch.randperm(batch, generator=g)[:num_rows]
    return logits, bitmask, rows


# (batch, vocab, bitmask words, rows): vocab % 32 != 0 (the last word partial), the logits wider
# than the bitmask covers (tokens past it masked), the bitmask wider than the logits (bits past
# V ignored), more words than one program's block, a single row
CASES = [
    (5, 70, 3, 3),
    (6, 300, 8, 4),
    (4, 100, 5, 2),
    (7, 4099 * 2, 257, 5),
    (3, 32 * 130, 130, 3),
    (1, 33, 2, 1),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", CASES)
def test_cpu_path_matches_reference(case, dtype):
    batch, vocab, width, num_rows = case
    logits, bitmask, rows = random_case(batch, vocab, width, num_rows, dtype, seed=vocab)
    want = reference(logits, bitmask, rows)
    got = apply_token_bitmask_(logits.clone(), bitmask, rows)
    assert torch.equal(got, want)
    untouched = sorted(set(range(batch)) - set(rows.tolist()))
    assert torch.equal(got[untouched], logits[untouched])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", CASES)
def test_kernel_matches_reference(tb, case, dtype):
    batch, vocab, width, num_rows = case
    logits, bitmask, rows = random_case(batch, vocab, width, num_rows, dtype, seed=vocab + 1)
    want = reference(logits, bitmask, rows)
    dev = device()
    got = logits.to(dev)
    tb.launch(got, bitmask.to(dev), rows.to(dev))
    assert torch.equal(got.cpu(), want)


def test_strided_rows_and_row_subset(tb):
    """Rows of a wider buffer (as tensor parallelism's gathered logits cut to the vocabulary)
    and int32 row indices: only the named rows' first V columns change, on both paths."""
    batch, vocab, width = 6, 150, 5
    logits, bitmask, rows = random_case(batch, vocab, width, 3, torch.float32, seed=7)
    want = reference(logits, bitmask, rows)
    for apply, dev in ((_apply_torch, torch.device("cpu")), (tb.launch, device())):
        wide = torch.full((batch, vocab + 10), 7.0, device=dev)
        wide[:, :vocab] = logits.to(dev)
        view = wide[:, :vocab]
        apply(view, bitmask.to(dev), rows.to(dev, torch.int32))
        assert torch.equal(view.cpu(), want)
        assert torch.equal(wide[:, vocab:].cpu(), torch.full((batch, 10), 7.0))


def test_cpu_path_chunks_many_rows():
    """More rows than one unpacked chunk, in shuffled order, in order (a chunk of consecutive
    rows is filled in one call), and in order then shuffled; the logits wider than the bitmask
    covers; a consecutive run past the last row raises as a single row does."""
    logits, bitmask, rows = random_case(150, 70, 2, 150, torch.float32, seed=3)
    in_order = torch.arange(150)
    partly = torch.cat([torch.arange(100), 100 + torch.randperm(50)])
    for order in (rows, in_order, partly, in_order.flip(0)):
        got = apply_token_bitmask_(logits.clone(), bitmask, order)
        assert torch.equal(got, reference(logits, bitmask, order))
    with pytest.raises(IndexError):
        apply_token_bitmask_(logits[:100].clone(), bitmask, in_order)


def test_bad_arguments_raise_naming_them():
    logits, bitmask, rows = random_case(4, 64, 2, 2, torch.float32, seed=0)
    with pytest.raises(ValueError, match="logits must be"):
        apply_token_bitmask_(logits[0], bitmask, rows)
    with pytest.raises(ValueError, match="logits must be"):
        apply_token_bitmask_(logits.t(), bitmask, rows)
    with pytest.raises(ValueError, match="bitmask must be int32"):
        apply_token_bitmask_(logits, bitmask.long(), rows)
    with pytest.raises(ValueError, match=r"row_indices must be \[R\] = \[2\]"):
        apply_token_bitmask_(logits, bitmask, rows[:1])
    if torch.cuda.is_available():
        with pytest.raises(ValueError, match="must be on logits' device"):
            apply_token_bitmask_(logits.cuda(), bitmask, rows.cuda())
    empty = torch.zeros(0, 2, dtype=torch.int32)
    assert torch.equal(apply_token_bitmask_(logits.clone(), empty, rows[:0]), logits)


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_sampler_masks_constrained_rows_only_and_keeps_callers_logits(temperature):
    """Greedy (a masked copy) and random (the float32 copy masked in place): each constrained
    row draws an allowed token, the free rows draw as without a grammar, and the caller's
    logits are unchanged."""
    vocab, batch = 200, 6
    logits, bitmask, rows = random_case(batch, vocab, 7, 3, torch.float32, seed=11)
    bitmask[0] = 0
    bitmask[0, 6] = 1 << 3  # token 195 only
    before = logits.clone()
    params = SamplingParams(temperature=temperature)
    sample_rows = [
        SamplingRow(params, [1], [], torch.Generator().manual_seed(i)) for i in range(batch)
    ]
    out = Sampler(seed=0).launch(logits, sample_rows, (bitmask, rows)).result()
    assert torch.equal(logits, before)
    masked = reference(logits, bitmask, rows)
    assert out.token_ids[rows[0]] == 195
    for k, row in enumerate(rows.tolist()):
        assert masked[row, out.token_ids[row]] > float("-inf"), (k, row)
    free = sorted(set(range(batch)) - set(rows.tolist()))
    plain_rows = [
        SamplingRow(params, [1], [], torch.Generator().manual_seed(i)) for i in range(batch)
    ]
    plain = Sampler(seed=0).launch(logits, plain_rows).result()
    assert [out.token_ids[i] for i in free] == [plain.token_ids[i] for i in free]
    assert out.num_nonfinite == [0] * batch


COMPILE_FOR_HOPPER = r"""
import torch, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from phloem.ops import token_bitmask_triton as tb

fn = tb._token_bitmask_kernel
for ty in ("*bf16", "*fp32"):
    types = dict(logits_ptr=ty, mask_ptr="*i32", rows_ptr="*i64", vocab="i32", num_words="i32",
                 s_logits="i32", s_mask="i32")
    sig = {n: "constexpr" if n == "BLOCK_WORDS" else types[n] for n in fn.arg_names}
    src = ASTSource(fn=fn, signature=sig, constexprs={"BLOCK_WORDS": tb.BLOCK_WORDS})
    ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4)).asm["ptx"]
    assert "st.global" in ptx
    print("compiled", ty)
"""


def test_kernel_compiles_for_hopper(compile_for_hopper):
    """The GPU compiler (stricter than the interpreter) takes the kernel for bf16 and float32
    logits (the greedy and the random sampling paths)."""
    assert compile_for_hopper(COMPILE_FOR_HOPPER).count("compiled") == 2


def test_bitmask_to_device_copies_both_arrays():
    """The step's bitmask and row indices reach logits' device unchanged (on a GPU through the
    copy stream, which the current stream waits for: the mask applied right after reads them)."""
    from phloem.ops.token_bitmask import bitmask_to_device

    logits, bitmask, rows = random_case(5, 70, 3, 3, torch.float32, seed=5)
    dev = device()
    on_device = bitmask_to_device(bitmask.numpy(), rows.numpy(), dev)
    assert [t.device.type for t in on_device] == [dev.type] * 2
    assert torch.equal(on_device[0].cpu(), bitmask) and torch.equal(on_device[1].cpu(), rows)
    got = apply_token_bitmask_(logits.to(dev), *on_device)
    assert torch.equal(got.cpu(), reference(logits, bitmask, rows))


def test_noise_drawn_before_the_bitmask_gives_the_same_tokens():
    """A constrained step draws its random rows' noise while its bitmask is filled
    (`Sampler.draw_noise`, `ModelRunner.presample`): the same tokens as drawing it at sampling,
    for seeded rows, rows on the sampler's generator and greedy rows mixed; a wrong shape
    raises."""
    vocab, batch = 300, 6
    logits, bitmask, rows = random_case(batch, vocab, 10, 4, torch.float32, seed=13)
    temps = [0.0, 0.9, 1.2, 0.0, 0.7, 1.0]

    def sample_rows():
        return [SamplingRow(SamplingParams(temperature=t, top_k=50 if i == 2 else 0), [1], [],
                            torch.Generator().manual_seed(i) if i % 2 else None)
                for i, t in enumerate(temps)]  # fmt: skip

    plain = Sampler(seed=3).launch(logits, sample_rows(), (bitmask, rows)).result()
    sampler, drawn_rows = Sampler(seed=3), sample_rows()
    noise = sampler.draw_noise(drawn_rows, vocab, logits.device)
    assert noise is not None and noise.shape == (4, vocab)
    early = sampler.launch(logits, drawn_rows, (bitmask, rows), noise).result()
    assert early.token_ids == plain.token_ids
    greedy = [SamplingRow(SamplingParams(temperature=0.0), [1], [], None)] * batch
    assert sampler.draw_noise(greedy, vocab, logits.device) is None
    with pytest.raises(ValueError, match=r"noise must be \[random rows, V\]"):
        sampler.launch(logits, sample_rows(), None, noise[:3])


# the kinds of row the sampler treats apart: plain greedy, greedy with log-probs, seeded (seed
# stream or generator) at several temperatures with top-k, top-p, min-p or penalties, and the
# sampler's own generator with log-probs
ROW_KINDS = [
    dict(temperature=0.0),
    dict(temperature=0.0, logprobs=2),
    dict(temperature=0.8, seed=1),
    dict(temperature=1.1, seed=2, top_k=7),
    dict(temperature=0.7, seed=3, top_p=0.8),
    dict(temperature=0.9, seed=4, min_p=0.05),
    dict(temperature=0.6, seed=5, repetition_penalty=1.3, frequency_penalty=0.4),
    dict(temperature=1.0, logprobs=3),
]


def kind_rows(kinds: list[dict], batch: int, cls=SamplingRow, bans=True) -> list[SamplingRow]:
    """`batch` fresh rows cycling through `kinds` (with `bans`, every fifth with a banned id):
    the same seeds, streams and draws each call."""
    rows = []
    for i in range(batch):
        params = SamplingParams(**kinds[i % len(kinds)])
        seeded = params.seed is not None
        stream = SeedStream(100 + i) if seeded and i % 2 == 0 else None
        generator = torch.Generator().manual_seed(i) if seeded and stream is None else None
        rows.append(
            cls(params, [1, 2, 5], [5, 9], generator, [3] if bans and i % 5 == 1 else [], stream)
        )
    return rows


def allowing_bitmask(batch: int, vocab: int, seed: int) -> torch.Tensor:
    """int32 [batch, ceil(V / 32)] random bits, token 0 allowed in every row."""
    g = torch.Generator().manual_seed(seed)
    words = -(-vocab // 32)
    return torch.randint(-(2**31), 2**31 - 1, (batch, words), dtype=torch.int32, generator=g) | 1


@pytest.mark.parametrize("kinds", ["mixed", "random", "plain", "logprobs"])
def test_prepared_sampling_masked_last_samples_as_masked_first(kinds):
    """A constrained step runs its bans, penalties and temperature before the grammar mask
    (`Sampler.prepare` while the bitmask is filled, `PreparedSampling.finish` after): its
    tokens, log-probs and draws are bit for bit those of the logits masked first (the float32
    logits masked, then sampled without a grammar), with the noise drawn before or by it
    ("logprobs": no bans or penalties, so the float32 copy the log-probs read is the one the
    temperature divides: it must not be divided in place)."""
    vocab, batch = 300, 24
    chosen = {"mixed": ROW_KINDS, "random": ROW_KINDS[2:7], "plain": ROW_KINDS[:1],
              "logprobs": [ROW_KINDS[i] for i in (1, 7, 2)]}[kinds]  # fmt: skip
    bans = kinds != "logprobs"
    logits = torch.randn(batch, vocab, generator=torch.Generator().manual_seed(5)) * 3
    constrained = torch.randperm(batch, generator=torch.Generator().manual_seed(6))[:18]
    grammar = (allowing_bitmask(18, vocab, seed=7), constrained)
    masked_first = apply_token_bitmask_(logits.clone(), *grammar)
    want_rows = kind_rows(chosen, batch, bans=bans)
    want = Sampler(seed=3).launch(masked_first, want_rows).result()
    for early in (False, True):
        sampler, rows = Sampler(seed=3), kind_rows(chosen, batch, bans=bans)
        noise = sampler.draw_noise(rows, vocab, logits.device) if early else None
        got = sampler.prepare(logits, rows, noise).finish(grammar).result()
        assert got.token_ids == want.token_ids
        assert got.logprobs == want.logprobs and got.top_logprobs == want.top_logprobs
        if kinds == "logprobs":  # of the masked logits as given (`launch` above shares the code)
            tokens = torch.tensor(got.token_ids)[:, None]
            raw = masked_first.gather(1, tokens)[:, 0] - masked_first.logsumexp(dim=-1)
            assert got.logprobs == raw.tolist()
        assert [r.seed_stream and r.seed_stream.draws for r in rows] == [
            r.seed_stream and r.seed_stream.draws for r in want_rows
        ]


class WatchedRow(SamplingRow):
    """A sampling row that counts the reads of its fields while `armed`."""

    armed = False
    reads = 0

    def __getattribute__(self, name: str):
        if type(self).armed:
            WatchedRow.reads += 1
        return super().__getattribute__(name)


def count_ops(fn, *args) -> int:
    """The torch operators `fn(*args)` dispatches."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        num = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Count.num += 1
            return func(*args, **(kwargs or {}))

    with Count():
        fn(*args)
    return Count.num


def test_prepared_sampling_finish_reads_no_row_and_dispatches_fixed_ops():
    """What a constrained step enqueues after its bitmask fill (`PreparedSampling.finish`,
    the noise drawn before as `ModelRunner.presample` draws it) reads no sampling row and
    dispatches as many operators at 8 rows as at 64, for every kind of row: no Python a row
    on the step's critical chain (issue 21: at 1,024 rows most of that enqueue's host time)."""
    vocab, counts = 300, []
    for batch in (8, 64):
        rows = kind_rows(ROW_KINDS, batch, cls=WatchedRow)
        logits = torch.randn(batch, vocab, generator=torch.Generator().manual_seed(batch))
        grammar = (allowing_bitmask(batch, vocab, seed=batch), torch.arange(batch))
        sampler = Sampler(seed=0)
        prepared = sampler.prepare(logits, rows, sampler.draw_noise(rows, vocab, "cpu"))
        WatchedRow.reads, WatchedRow.armed = 0, True
        try:
            counts.append(count_ops(prepared.finish, grammar))
        finally:
            WatchedRow.armed = False
        assert WatchedRow.reads == 0
    assert counts[0] == counts[1] < 100, counts
