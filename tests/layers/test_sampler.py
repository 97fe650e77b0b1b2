"""Tests for phloem.layers.sampler: greedy, determinism, truncation, penalties, log-probs.

Statistical tests use fixed seeds and one batched draw of many identical rows, so they are
deterministic; their tolerances (5 sigma per token) catch any wrong distribution by a wide margin.
The float64 reference below (`reference_allowed`, `reference_probs`) is deliberately plain.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from phloem.layers.sampler import Sampler, SamplingRow, apply_penalties
from phloem.ops.seeded_noise import SeedStream
from phloem.sampling_params import SamplingParams

torch.set_num_threads(1)

LOGITS8 = [2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -2.0]


def gen(seed: int) -> torch.Generator:
    g = torch.Generator()
    g.manual_seed(seed)
    return g


def row(params=None, prompt=(), output=(), generator=None, banned=(), stream=None) -> SamplingRow:
    return SamplingRow(
        params or SamplingParams(), list(prompt), list(output), generator, list(banned), stream
    )


# --- float64 reference -----------------------------------------------------------------------


def reference_penalties(logits: list[float], prompt, output, params: SamplingParams) -> list[float]:
    out = []
    for t, x in enumerate(logits):
        if t in prompt or t in output:
            r = params.repetition_penalty
            x = x / r if x > 0 else x * r
        c = list(output).count(t)
        x -= params.frequency_penalty * c + params.presence_penalty * (c > 0)
        out.append(x)
    return out


def reference_allowed(logits, params, prompt=(), output=(), banned=(), tol=0.0) -> set[int]:
    """Tokens the sampler may return. With tol > 0 every comparison is made lenient, which can
    only grow the set, so float32 rounding in the sampler never makes a correct token 'illegal'."""
    z = reference_penalties(logits, prompt, output, params)
    alive = [t for t in range(len(z)) if t not in banned]
    if params.temperature < 1e-5:
        best = max(z[t] for t in alive)
        return {t for t in alive if z[t] >= best - tol}
    z = [x / params.temperature for x in z]
    best = max(z[t] for t in alive)
    if params.min_p > 0:
        alive = [t for t in alive if z[t] - best >= math.log(params.min_p) - tol]
    if 0 < params.top_k < len(alive):
        kth = sorted((z[t] for t in alive), reverse=True)[params.top_k - 1]
        alive = [t for t in alive if z[t] >= kth - tol]
    if params.top_p < 1.0:
        total = sum(math.exp(z[t] - best) for t in alive)
        alive = [
            t
            for t in alive
            if sum(math.exp(z[u] - best) for u in alive if z[u] > z[t] + tol) / total
            < params.top_p + tol
        ]
    return set(alive)


def reference_probs(logits, params) -> list[float]:
    """The exact distribution for distinct, well-separated logits and no penalties."""
    allowed = reference_allowed(logits, params)
    weights = [
        math.exp(x / params.temperature) if t in allowed else 0.0 for t, x in enumerate(logits)
    ]
    return [w / sum(weights) for w in weights]


def empirical(logits: list[float], params: SamplingParams, n: int = 20000, seed: int = 0):
    """Frequencies of n draws from one batched call over n identical unseeded rows."""
    batch = torch.tensor([logits], dtype=torch.float32).expand(n, -1)
    out = Sampler(seed=seed)(batch, [row(params)] * n)
    counts = torch.bincount(torch.tensor(out.token_ids), minlength=len(logits))
    return (counts.double() / n).tolist()


def assert_frequencies(freq: list[float], probs: list[float], n: int) -> None:
    for t, (f, p) in enumerate(zip(freq, probs)):
        if p == 0.0:
            assert f == 0.0, f"token {t} has probability 0 but frequency {f}"
        else:
            sigma = math.sqrt(p * (1 - p) / n)
            assert abs(f - p) <= 5 * sigma + 1e-9, f"token {t}: frequency {f:.4f} vs p {p:.4f}"


# --- greedy ----------------------------------------------------------------------------------


def test_greedy_is_argmax():
    logits = torch.randn(16, 50, generator=gen(1))
    out = Sampler()(logits, [row(SamplingParams(temperature=0.0)) for _ in range(16)])
    assert out.token_ids == logits.argmax(dim=-1).tolist()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_plain_greedy_on_half_logits_equals_float32_path(dtype):
    """The all-greedy fast path takes argmax in the logits' own dtype: same ids as the float32
    path (first index among ties, which half precision makes common), and the same logprobs
    when one row asks for them (that step goes the float32 way)."""
    logits = (torch.randn(32, 300, generator=gen(2)) * 4).to(dtype)
    logits[3, 7] = logits[3, 250] = logits[3].max() + 1  # a tie: the first index wins
    greedy = [row(SamplingParams(temperature=0.0)) for _ in range(32)]
    out = Sampler()(logits, greedy)
    assert out.token_ids == logits.float().argmax(dim=-1).tolist()
    assert out.token_ids[3] == 7 and out.logprobs == [None] * 32
    with_lp = greedy[:-1] + [row(SamplingParams(temperature=0.0, logprobs=2))]
    out_lp = Sampler()(logits, with_lp)
    assert out_lp.token_ids == out.token_ids
    expected = torch.log_softmax(logits[-1].float(), dim=-1)[out.token_ids[-1]].item()
    assert out_lp.logprobs[-1] == pytest.approx(expected, abs=1e-5)


def test_greedy_rows_consume_no_randomness():
    greedy = SamplingParams(temperature=0.0)
    sampled = SamplingParams(temperature=1.0)
    logits = torch.randn(3, 40, generator=gen(2))

    # A greedy row's own generator is not advanced.
    g = gen(3)
    state = g.get_state()
    Sampler()(logits[:1], [row(greedy, generator=g)])
    assert torch.equal(g.get_state(), state)

    # The sampler's shared draw is the same with or without greedy neighbours.
    alone, mixed = Sampler(seed=7), Sampler(seed=7)
    for _ in range(5):
        a = alone(logits[1:2], [row(sampled)]).token_ids[0]
        m = mixed(logits, [row(greedy), row(sampled), row(greedy)]).token_ids[1]
        assert a == m

    # A seeded row is unchanged by greedy neighbours.
    g1, g2 = gen(11), gen(11)
    for _ in range(5):
        a = Sampler()(logits[1:2], [row(sampled, generator=g1)]).token_ids[0]
        m = Sampler()(logits, [row(greedy), row(sampled, generator=g2), row(greedy)]).token_ids[1]
        assert a == m


# --- determinism -----------------------------------------------------------------------------


TARGET = SamplingParams(temperature=0.9, top_k=40, top_p=0.95, repetition_penalty=1.1, seed=5)
NEIGHBOURS = [
    SamplingParams(temperature=0.0),
    SamplingParams(temperature=1.3),
    SamplingParams(temperature=0.7, top_p=0.5, seed=9),
    SamplingParams(temperature=1.0, min_p=0.1, frequency_penalty=0.5),
    SamplingParams(temperature=2.0, top_k=3),
]


def run_seeded(
    batch_size: int, position: int, steps: int = 6, seed: int = 5, streams: bool = False
) -> list[int]:
    """Generate `steps` tokens for TARGET at `position` in a batch of varied neighbours; its
    randomness and the seeded neighbours' from generators, or from seed streams (`streams`)."""
    vocab = 64
    step_logits = torch.randn(steps, vocab, generator=gen(100))
    g, stream = gen(seed), SeedStream(seed)
    sampler = Sampler(seed=batch_size * 10 + position)
    noise = gen(batch_size * 100 + position)
    neighbour_streams = [SeedStream(1000 + i) for i in range(batch_size)]
    outputs: list[int] = []
    for step in range(steps):
        logits = torch.randn(batch_size, vocab, generator=noise)
        logits[position] = step_logits[step]
        rows = []
        for i in range(batch_size):
            if i == position:
                rows.append(row(TARGET, [1, 2, 3], outputs, None if streams else g, (),
                                stream if streams else None))  # fmt: skip
            else:
                params = NEIGHBOURS[(i + step) % len(NEIGHBOURS)]
                seeded = params.seed is not None
                nb_gen = gen(1000 + i) if seeded and not streams else None
                nb_stream = neighbour_streams[i] if seeded and streams else None
                rows.append(row(params, [4], [i], nb_gen, (), nb_stream))
        outputs.append(sampler(logits, rows).token_ids[position])
    return outputs


@pytest.mark.parametrize("streams", [False, True], ids=["generator", "seed_stream"])
def test_seeded_row_is_batch_invariant(streams):
    reference = run_seeded(batch_size=1, position=0, streams=streams)
    for batch_size, position in [(3, 0), (3, 2), (8, 1), (8, 4), (8, 7)]:
        got = run_seeded(batch_size, position, streams=streams)
        assert got == reference, (batch_size, position)
    assert run_seeded(batch_size=1, position=0, streams=streams) == reference  # across runs
    assert run_seeded(batch_size=1, position=0, seed=6, streams=streams) != reference


def test_a_generator_rows_noise_is_a_fresh_draw_from_it():
    """A row with only a generator: its noise, drawn in place into its row, is the draw of a
    fresh length-V tensor."""
    rows = [row(SamplingParams(temperature=1.0), generator=gen(s)) for s in (3, 4)]
    noise = Sampler().draw_noise([rows[0], row(SamplingParams(temperature=1.0)), rows[1]], 9, "cpu")
    for k, s in [(0, 3), (2, 4)]:
        fresh = torch.empty(9).exponential_(generator=gen(s)).clamp_min_(torch.finfo().tiny)
        assert torch.equal(noise[k], fresh)


def test_a_seed_streams_noise_is_its_counter_draw_and_advances_it():
    """A row with a seed stream (and a generator, as the engine builds it): its noise is the
    stream's counter-based draw (the generator is not read), one draw per random step; greedy
    rows draw nothing."""
    from phloem.ops.seeded_noise import exponentials_reference, row_keys

    stream, g = SeedStream(11, draws=4), gen(11)
    state = g.get_state()
    sampled = row(SamplingParams(temperature=1.0), generator=g, stream=stream)
    greedy_stream = SeedStream(12)
    greedy = row(SamplingParams(temperature=0.0), stream=greedy_stream)
    want = exponentials_reference(row_keys([SeedStream(11, draws=4)]), 9)[0]
    noise = Sampler().draw_noise([greedy, row(SamplingParams(temperature=1.0)), sampled], 9, "cpu")
    assert torch.equal(noise[1], want)
    assert stream.draws == 5 and greedy_stream.draws == 0
    assert torch.equal(g.get_state(), state)
    Sampler()(torch.zeros(2, 9), [sampled, greedy])
    assert stream.draws == 6 and greedy_stream.draws == 0


# --- truncation and temperature distributions ------------------------------------------------


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1.0, top_k=3),
        SamplingParams(temperature=1.0, top_p=0.7),
        SamplingParams(temperature=1.0, min_p=0.2),
        SamplingParams(temperature=0.5),
        SamplingParams(temperature=1.0, top_k=2, top_p=0.6),  # top-p sees the top-2 mass only
        SamplingParams(temperature=0.8, min_p=0.02, top_k=4, top_p=0.9),
    ],
    ids=["top_k", "top_p", "min_p", "temperature", "top_k_then_top_p", "combined"],
)
def test_distribution_matches_renormalized_reference(params):
    n = 20000
    probs = reference_probs(LOGITS8, params)
    assert_frequencies(empirical(LOGITS8, params, n=n), probs, n)


def test_truncated_supports_are_the_expected_sets():
    assert reference_allowed(LOGITS8, SamplingParams(top_k=3)) == {0, 1, 2}
    assert reference_allowed(LOGITS8, SamplingParams(top_p=0.7)) == {0, 1, 2}
    assert reference_allowed(LOGITS8, SamplingParams(min_p=0.2)) == {0, 1, 2, 3}
    assert reference_allowed(LOGITS8, SamplingParams(top_k=2, top_p=0.6)) == {0}
    combined = SamplingParams(temperature=0.8, min_p=0.02, top_k=4, top_p=0.9)
    assert reference_allowed(LOGITS8, combined) == {0, 1, 2}


def test_higher_temperature_gives_higher_entropy():
    def entropy(freq):
        return -sum(f * math.log(f) for f in freq if f > 0)

    entropies = [
        entropy(empirical(LOGITS8, SamplingParams(temperature=t), n=10000)) for t in (0.3, 1, 3)
    ]
    assert entropies[0] + 0.2 < entropies[1] < entropies[2] - 0.2, entropies


# --- penalties -------------------------------------------------------------------------------


def test_apply_penalties_matches_formula():
    g = gen(4)
    batch, vocab = 6, 20
    logits = torch.randn(batch, vocab, generator=g) * 3
    prompts = [torch.randint(0, vocab, (int(n),), generator=g).tolist() for n in (0, 3, 5, 9, 1, 7)]
    outputs = [
        torch.randint(0, vocab, (int(n),), generator=g).tolist() for n in (4, 0, 12, 6, 2, 8)
    ]
    rep = (torch.rand(batch, generator=g) * 1.5 + 0.5).tolist()
    freq = (torch.rand(batch, generator=g) * 4 - 2).tolist()
    pres = (torch.rand(batch, generator=g) * 4 - 2).tolist()
    before = logits.clone()
    got = apply_penalties(
        logits, prompts, outputs, torch.tensor(rep), torch.tensor(freq), torch.tensor(pres)
    )
    assert torch.equal(logits, before)
    for i in range(batch):
        params = SamplingParams(
            repetition_penalty=rep[i], frequency_penalty=freq[i], presence_penalty=pres[i]
        )
        want = reference_penalties(logits[i].double().tolist(), prompts[i], outputs[i], params)
        torch.testing.assert_close(
            got[i].double(), torch.tensor(want, dtype=torch.float64), atol=1e-5, rtol=1e-5
        )
        assert not torch.equal(got[i], logits[i])


def test_sampler_applies_penalties_only_to_their_rows():
    logits = torch.tensor([[3.0, 2.5, -1.0, 0.0]] * 3)
    rows = [
        row(SamplingParams(temperature=0.0), output=[0]),  # no penalty: token 0 wins
        row(SamplingParams(temperature=0.0, frequency_penalty=0.3), output=[0, 0]),  # 3 - 0.6
        row(SamplingParams(temperature=0.0, repetition_penalty=2.0), prompt=[0]),  # 3 / 2
    ]
    assert Sampler()(logits, rows).token_ids == [0, 1, 1]


# --- banned tokens, log-probs, input immutability --------------------------------------------


def test_banned_tokens_are_never_sampled():
    n, banned = 5000, [0, 1, 2, 99]  # 99 >= V is ignored
    logits = torch.tensor([[9.0, 8.0, 8.0, 1.0, 0.5, 0.0]]).expand(n, -1)
    rows = [row(SamplingParams(temperature=1.5), banned=banned) for _ in range(n)]
    rows[0] = row(SamplingParams(temperature=0.0), banned=banned)
    out = Sampler()(logits, rows)
    assert out.token_ids[0] == 3
    assert set(out.token_ids) == {3, 4, 5}


def test_logprobs_are_raw_and_top_k_has_k_or_k_plus_one_entries():
    logits = torch.randn(5, 30, generator=gen(6)) * 2
    top = logits.argsort(dim=-1, descending=True)
    rows = [
        row(
            SamplingParams(temperature=0.0, logprobs=3), banned=top[0, :4].tolist()
        ),  # not in top 3
        row(SamplingParams(temperature=0.0, logprobs=3)),  # in top 3
        row(
            SamplingParams(temperature=0.7, top_k=5, repetition_penalty=1.5, logprobs=0), output=[1]
        ),
        row(SamplingParams(temperature=1.2, min_p=0.05, logprobs=5), generator=gen(8)),
        row(SamplingParams(temperature=1.0)),
    ]
    before = logits.clone()
    out = Sampler()(logits, rows)
    assert torch.equal(logits, before)
    raw = torch.log_softmax(logits.double(), dim=-1)
    for i, token in enumerate(out.token_ids):
        assert out.logprobs[i] == pytest.approx(raw[i, token].item(), abs=1e-5)
    assert out.top_logprobs[4] is None
    assert list(out.top_logprobs[2]) == [out.token_ids[2]]
    assert len(out.top_logprobs[0]) == 4 and len(out.top_logprobs[1]) == 3
    for i, k in [(0, 3), (1, 3), (3, 5)]:
        entry = out.top_logprobs[i]
        assert set(top[i, :k].tolist()) | {out.token_ids[i]} == set(entry)
        for token, lp in entry.items():
            assert lp == pytest.approx(raw[i, token].item(), abs=1e-5)


def test_rejects_mismatched_rows():
    with pytest.raises(ValueError, match="len\\(rows\\)"):
        Sampler()(torch.zeros(2, 5), [row()])


# --- property: the sampled token is always allowed -------------------------------------------


@st.composite
def sampling_case(draw):
    vocab = draw(st.integers(2, 10))
    logits = draw(st.lists(st.integers(-16, 16), min_size=vocab, max_size=vocab))
    params = SamplingParams(
        temperature=draw(st.sampled_from([0.0, 0.05, 0.3, 1.0, 2.5])),
        top_k=draw(st.integers(-1, vocab + 1)),
        top_p=draw(st.sampled_from([0.05, 0.3, 0.5, 0.8, 0.95, 1.0])),
        min_p=draw(st.sampled_from([0.0, 0.01, 0.2, 0.6, 1.0])),
        repetition_penalty=draw(st.sampled_from([0.7, 1.0, 1.3])),
        frequency_penalty=draw(st.sampled_from([-1.0, 0.0, 0.5])),
        presence_penalty=draw(st.sampled_from([-0.5, 0.0, 1.0])),
    )
    ids = st.lists(st.integers(0, vocab - 1), max_size=6)
    banned = draw(st.lists(st.integers(0, vocab - 1), max_size=vocab - 1, unique=True))
    return [x / 4 for x in logits], params, draw(ids), draw(ids), banned, draw(st.integers(0, 99))


@settings(max_examples=300, deadline=None)
@given(case=sampling_case(), position=st.integers(0, 2))
def test_sampled_token_is_in_reference_allowed_set(case, position):
    logits, params, prompt, output, banned, seed = case
    allowed = reference_allowed(logits, params, prompt, output, banned, tol=1e-3)
    batch = torch.randn(3, len(logits), generator=gen(seed))
    batch[position] = torch.tensor(logits)
    rows = [row(SamplingParams(temperature=1.0)) for _ in range(3)]
    rows[position] = row(params, prompt, output, gen(seed), banned)
    token = Sampler(seed=seed)(batch, rows).token_ids[position]
    assert token in allowed, (token, allowed)


def test_top_k_top_p_fast_path_equals_full_sort(monkeypatch):
    """The candidate fast path (sort only the top 1024) keeps exactly the tokens a full sort does."""
    import phloem.layers.logits_processors as sampler_module

    gen = torch.Generator().manual_seed(0)
    for trial in range(60):
        b, v = 6, 5000
        logits = torch.randn(b, v, generator=gen) * (torch.rand(b, 1, generator=gen) * 8)
        top_p = torch.rand(b, generator=gen) * 0.999 + 0.001
        if trial % 3 == 0:
            top_k = torch.full((b,), v)
        elif trial % 3 == 1:
            top_k = torch.randint(1, 1500, (b,), generator=gen)
        else:
            top_k = torch.randint(1, v + 1, (b,), generator=gen)
        fast = sampler_module.apply_top_k_top_p(logits, top_k, top_p)
        monkeypatch.setattr(sampler_module, "_TOP_P_CANDIDATES", 10**9)
        full = sampler_module.apply_top_k_top_p(logits, top_k, top_p)
        monkeypatch.undo()
        assert torch.equal(fast.isinf(), full.isinf()), trial


# --- non-finite rows ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.8, top_k=3),
        SamplingParams(temperature=0.0, logprobs=2),
        SamplingParams(temperature=0.8, repetition_penalty=1.5),
    ],
    ids=["greedy", "random", "logprobs", "penalties"],
)
def test_non_finite_rows_are_flagged_and_leave_the_others_alone(params):
    """Rows with NaN or inf are flagged per row (not raised on) and sampled as placeholders;
    the finite rows draw exactly what they draw without the bad rows' values."""
    torch.manual_seed(0)
    clean = torch.randn(4, 50)
    logits = clean.clone()
    logits[1, 7] = float("nan")
    logits[3, :3] = float("inf")
    logits[3, 10] = float("-inf")

    def sample(x):
        rows = [row(params, prompt=[1, 2], output=[3], generator=gen(i)) for i in range(4)]
        return Sampler(seed=1).launch(x, rows).result()

    want, got = sample(clean), sample(logits)
    assert got.num_nonfinite == [0, 1, 0, 1]
    assert want.num_nonfinite == [0, 0, 0, 0]
    assert all(0 <= t < 50 for t in got.token_ids)
    for i in (0, 2):
        assert got.token_ids[i] == want.token_ids[i]
        assert got.logprobs[i] == want.logprobs[i]
    assert torch.isnan(logits[1, 7])  # the caller's logits are not modified


def test_plain_greedy_picks_the_first_of_tied_maxima_and_flags_only_nan_or_inf():
    """The plain greedy step takes ids and non-finite flags from one max pass: ties go to the
    first index (as argmax), a row with NaN or +inf is flagged, a -inf mask entry is not."""
    logits = torch.zeros(4, 12, dtype=torch.bfloat16)
    logits[0, [3, 7]] = 2.0  # tie: 3
    logits[1, 5] = float("-inf")  # a masked entry, max 0 at index 0
    logits[2, 9] = float("nan")
    logits[3, 4] = float("inf")
    rows = [row(SamplingParams(temperature=0)) for _ in range(4)]
    out = Sampler(seed=0).launch(logits, rows).result()
    assert out.token_ids[:2] == [3, 0] == logits[:2].float().argmax(dim=-1).tolist()
    assert out.num_nonfinite == [0, 0, 1, 1]
