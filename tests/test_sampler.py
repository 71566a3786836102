import random

import pytest
import torch

from engine.worker import sampler
from engine.worker.sampler import SamplingRow, make_generator, sample
from engine.core.sampling_params import SamplingParams

hf = pytest.importorskip("transformers.generation.logits_process")


def row(seed=None, token_ids=(), num_samples=1, **params):
    return SamplingRow(SamplingParams(seed=seed, **params), list(token_ids), make_generator(seed), num_samples)


def random_logits(rows, vocab, seed=0, scale=3.0):
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * scale


def hf_reference(logits, token_ids=None, temperature=1.0, top_k=-1, top_p=1.0, penalty=1.0):
    """The same logits through transformers' processors, in the order `generate` applies them."""
    scores = logits.float().clone()
    ids = torch.tensor([token_ids or []] * scores.shape[0], dtype=torch.long)
    if penalty != 1.0:
        scores = hf.RepetitionPenaltyLogitsProcessor(penalty)(ids, scores)
    if temperature != 1.0:
        scores = hf.TemperatureLogitsWarper(temperature)(ids, scores)
    if top_k != -1:
        scores = hf.TopKLogitsWarper(top_k)(ids, scores)
    if top_p != 1.0:
        scores = hf.TopPLogitsWarper(top_p)(ids, scores)
    return scores


def frequencies(tokens, vocab):
    return torch.bincount(torch.tensor(tokens), minlength=vocab).double() / len(tokens)


def assert_matches_distribution(tokens, probs):
    """Chi-square against `probs` (zero-probability tokens must never appear), and a max abs diff."""
    probs = probs.double()
    observed = frequencies(tokens, len(probs))
    assert observed[probs == 0].sum() == 0
    support = probs > 0
    expected = probs[support] * len(tokens)
    chi2 = float(((observed[support] * len(tokens) - expected) ** 2 / expected).sum())
    dof = int(support.sum()) - 1
    assert chi2 < dof + 8 * (2 * dof) ** 0.5 + 10, (chi2, dof)  # far beyond p = 1e-6 for these sizes
    assert float((observed - probs).abs().max()) < 0.015


def test_make_generator_is_seeded_or_none():
    assert make_generator(None) is None
    generator = make_generator(1234)
    assert generator.device == torch.device("cpu")
    assert torch.equal(torch.rand(8, generator=generator), torch.rand(8, generator=torch.Generator().manual_seed(1234)))


def test_greedy_is_argmax_and_ties_go_to_the_lowest_index():
    logits = random_logits(64, 500)
    logits[3, [7, 300]] = 100.0  # a tie
    out = sample(logits, [row(temperature=0, num_samples=1 + i % 3) for i in range(64)])
    expected = logits.argmax(dim=-1).tolist()
    assert out == [[token] * (1 + i % 3) for i, token in enumerate(expected)]
    assert out[3] == [7]


def test_a_known_argmax_serves_plain_greedy_rows_only():
    """The compiled decode step hands its logits' argmax along: a greedy row with nothing to ban
    or penalize takes it (here a deliberately different token, to see that it is used); one
    with a penalty or a ban computes its own; sampled rows ignore it."""
    logits = random_logits(3, 500)
    known = (logits.argmax(dim=-1) + 1) % 500
    plain, penalized, banned = (row(temperature=0), row(temperature=0, token_ids=[5], repetition_penalty=1.3),
                                row(temperature=0))
    top = int(logits[2].argmax())
    banned.banned_token_ids = frozenset({top})
    assert sample(logits[:1], [plain], known[:1]) == [[int(known[0])]]
    assert sample(logits[1:2], [penalized], known[1:2]) == sample(logits[1:2], [penalized])
    assert sample(logits[2:], [banned], known[2:]) == sample(logits[2:], [banned]) != [[top]]
    mixed = [row(temperature=0), row(seed=1, temperature=1.0), row(temperature=0)]
    out = sample(logits, mixed, known)
    assert out[0] == [int(known[0])] and out[2] == [int(known[2])]
    assert out[1] == sample(logits[1:2], [row(seed=1, temperature=1.0)])[0]


@pytest.mark.parametrize("vocab", [49152, 32000, 1000, 50])
def test_the_chunked_argmax_is_torchs_on_ties_and_nan(vocab):
    logits = torch.randn(6, vocab, generator=torch.Generator().manual_seed(vocab))
    logits[1, [3, vocab - 2]] = 50.0                       # a tie: the first
    logits[2, :] = 1.0                                     # all tied: index 0
    logits[3, [vocab // 2, vocab - 1]] = float("nan")      # NaN wins, the first one
    logits[4, vocab - 1] = float("inf")
    logits[5, 0] = float("-inf")
    assert torch.equal(sampler.argmax(logits), logits.argmax(dim=-1))
    assert torch.equal(sampler.argmax(logits[:, :-1]), logits[:, :-1].argmax(dim=-1))  # not contiguous


def test_top_k_1_is_greedy():
    logits = random_logits(32, 500)
    out = sample(logits, [row(seed=i, temperature=1.5, top_k=1, num_samples=3) for i in range(32)])
    assert out == [[token] * 3 for token in logits.argmax(dim=-1).tolist()]


def test_tiny_top_p_keeps_only_the_top_token():
    logits = random_logits(32, 500)
    out = sample(logits, [row(seed=i, temperature=2.0, top_p=1e-6, num_samples=3) for i in range(32)])
    assert out == [[token] * 3 for token in logits.argmax(dim=-1).tolist()]


def test_a_seed_reproduces_its_tokens_whatever_else_is_in_the_batch():
    targets = [dict(seed=11, temperature=0.8), dict(seed=12, top_k=20, num_samples=4),
               dict(seed=13, temperature=1.2, top_p=0.9), dict(seed=14, temperature=0.9, top_k=50, top_p=0.8),
               dict(seed=15, repetition_penalty=1.3, token_ids=range(0, 1000, 3), num_samples=2)]
    others = [dict(temperature=0), dict(), dict(seed=99, temperature=0.5, top_p=0.5),
              dict(temperature=0.7, top_k=3, num_samples=5), dict(seed=98, repetition_penalty=0.5, token_ids=[1, 2])]
    target_logits = random_logits(len(targets), 1000, seed=1, scale=1.0)
    alone = [sample(target_logits[i:i + 1], [row(**spec)])[0] for i, spec in enumerate(targets)]
    assert sample(target_logits, [row(**spec) for spec in targets]) == alone

    entries = [(spec, target_logits[i], i) for i, spec in enumerate(targets)]
    entries += [(spec, logits, None) for spec, logits in zip(others, random_logits(len(others), 1000, seed=2))]
    random.Random(0).shuffle(entries)
    out = sample(torch.stack([logits for _, logits, _ in entries]), [row(**spec) for spec, _, _ in entries])
    assert [tokens for (_, _, target), tokens in zip(entries, out) if target is not None] == \
        [alone[target] for _, _, target in entries if target is not None]


def test_different_seeds_draw_different_tokens():
    logits = torch.zeros(2, 1000)
    first, second = sample(logits, [row(seed=1, num_samples=50), row(seed=2, num_samples=50)])
    assert first != second
    assert len(set(first)) > 40  # 50 draws from 1000 equally likely tokens rarely repeat much


def test_rows_without_a_generator_use_torchs_default_rng():
    logits = torch.zeros(3, 1000)
    torch.manual_seed(5)
    first = sample(logits, [row(num_samples=20) for _ in range(3)])
    torch.manual_seed(5)
    assert sample(logits, [row(num_samples=20) for _ in range(3)]) == first
    assert sample(logits, [row(num_samples=20) for _ in range(3)]) != first


def test_top_k_never_leaves_the_top_k():
    logits = random_logits(4, 300, scale=0.5)  # flat enough that every kept token turns up
    ks = [1, 5, 40, 299]
    out = sample(logits, [row(seed=i, top_k=k, num_samples=4000) for i, k in enumerate(ks)])
    for tokens, values, k in zip(out, logits, ks):
        top = set(values.topk(k).indices.tolist())
        assert set(tokens) <= top
        assert k > 40 or set(tokens) == top


# Nuclei inside the first window of largest logits, the second, and past both (the full-row fallback).
@pytest.mark.parametrize("vocab, top_p, size", [(2000, 0.3, (50, 256)), (6000, 0.5, (257, 4096)),
                                                (10000, 0.9, (4097, 10000))])
def test_top_p_never_leaves_the_nucleus(vocab, top_p, size):
    logits = random_logits(3, vocab, scale=1.0)
    out = sample(logits, [row(seed=i, top_p=top_p, num_samples=3000) for i in range(3)])
    for tokens, values in zip(out, logits):
        nucleus = hf_reference(values[None], top_p=top_p)[0].isfinite()
        assert size[0] <= nucleus.sum() <= size[1]
        assert nucleus[tokens].all()


@pytest.mark.parametrize("windows", [sampler.TOP_P_WINDOWS, (3, 40)])
def test_top_p_keeps_exactly_hugging_faces_nucleus(windows, monkeypatch):
    monkeypatch.setattr(sampler, "TOP_P_WINDOWS", windows)
    logits = random_logits(60, 500, seed=5, scale=2.0)
    p = torch.linspace(0.01, 0.99, 60)
    kept = sampler._mask_below(logits.clone(), sampler._top_p_thresholds(logits, p)).isfinite()
    for values, row_p, row_kept in zip(logits, p.tolist(), kept):
        assert torch.equal(row_kept, hf_reference(values[None], top_p=row_p)[0].isfinite())


def test_top_p_keeps_the_smallest_set_that_reaches_p():
    probs = torch.tensor([0.05, 0.5, 0.1, 0.2, 0.15])
    out = sample(probs.log()[None], [row(seed=0, top_p=0.75, num_samples=5000)])[0]
    assert set(out) == {1, 3, 4}  # 0.5 + 0.2 < 0.75 <= 0.5 + 0.2 + 0.15


def test_frequencies_follow_softmax_of_logits_over_temperature():
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -0.5, -1.0, 1.5, 0.25]])
    tokens = sample(logits, [row(seed=7, temperature=0.7, num_samples=20_000)])[0]
    assert_matches_distribution(tokens, (logits[0] / 0.7).softmax(dim=-1))


@pytest.mark.parametrize("windows", [sampler.TOP_P_WINDOWS, (2, 4), (1,)])
@pytest.mark.parametrize("settings", [dict(temperature=0.8, top_k=6), dict(temperature=1.3, top_p=0.8),
                                      dict(temperature=0.9, top_k=8, top_p=0.85),
                                      dict(temperature=1.0, penalty=1.5, top_p=0.95)])
def test_frequencies_follow_hugging_face_processors(settings, windows, monkeypatch):
    monkeypatch.setattr(sampler, "TOP_P_WINDOWS", windows)
    logits = random_logits(1, 12, seed=3, scale=1.0)
    seen = [0, 3, 3, 5, 11]
    params = {("repetition_penalty" if key == "penalty" else key): value for key, value in settings.items()}
    tokens = sample(logits, [row(seed=8, token_ids=seen, num_samples=20_000, **params)])[0]
    expected = hf_reference(logits, token_ids=seen, **settings)[0].softmax(dim=-1)
    assert_matches_distribution(tokens, expected)


@pytest.mark.parametrize("penalty", [1.3, 0.7])
def test_repetition_penalty_follows_hugging_face(penalty):
    logits = random_logits(6, 40, seed=4)
    seen = [1, 5, 5, 9, 17, 17, 17, 30, 39]
    expected = hf_reference(logits, token_ids=seen, penalty=penalty)
    penalized = logits.clone()
    sampler._apply_repetition_penalty_(penalized, [row(token_ids=seen, repetition_penalty=penalty)] * 6)
    assert torch.allclose(penalized, expected, rtol=1e-6, atol=0)
    lowered = torch.zeros(40, dtype=torch.bool)
    lowered[seen] = True
    assert ((penalized < logits) == (lowered if penalty > 1 else torch.zeros_like(lowered))).all()

    # Through sample(): seen token 17 leads unseen token 20 by 10%, which a penalty of 1.3 overturns.
    logits[:, 20] = logits.abs().max() + 1
    logits[:, 17] = logits[:, 20] * 1.1
    out = sample(logits, [row(temperature=0, token_ids=seen, repetition_penalty=penalty) for _ in range(6)])
    assert [tokens[0] for tokens in out] == hf_reference(logits, token_ids=seen, penalty=penalty).argmax(-1).tolist()
    assert out == [[20 if penalty > 1 else 17]] * 6


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_logits(dtype):
    logits = random_logits(8, 300).to(dtype)
    specs = [dict(seed=i, temperature=0.0 if i % 2 else 0.9, top_k=50, top_p=0.9, num_samples=3) for i in range(8)]
    out = sample(logits, [row(**spec) for spec in specs])
    assert out == sample(logits.float(), [row(**spec) for spec in specs])  # the same values, widened
    assert out[1] == [int(logits[1].float().argmax())] * 3
    assert all(isinstance(t, int) and 0 <= t < 300 for tokens in out for t in tokens)


def test_num_samples_returns_that_many_tokens():
    logits = torch.zeros(3, 100)
    out = sample(logits, [row(seed=0, num_samples=16), row(num_samples=1), row(temperature=0, num_samples=4)])
    assert [len(tokens) for tokens in out] == [16, 1, 4]
    assert len(set(out[0])) > 1 and out[2] == [0] * 4


def test_logits_are_left_untouched_and_shapes_checked():
    logits = random_logits(4, 50)
    before = logits.clone()
    greedy = dict(temperature=0, repetition_penalty=2.0, token_ids=[1, 2])
    tempered = dict(seed=1, temperature=0.5, top_k=3, top_p=0.5, repetition_penalty=2.0, token_ids=[3])
    for specs in ([greedy, tempered] * 2, [greedy] * 4, [tempered] * 4):
        sample(logits, [row(**spec) for spec in specs])
        assert torch.equal(logits, before)
    assert sample(torch.zeros(0, 50), []) == []
    with pytest.raises(ValueError):
        sample(logits, [row()])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_logits_with_cuda_generators():
    logits = random_logits(6, 1000).cuda().half()
    rows = [SamplingRow(SamplingParams(seed=i, temperature=0.0 if i == 0 else 0.8, top_k=40, top_p=0.9),
                        [1, 2, 3], make_generator(i, "cuda"), 2) for i in range(6)]
    out = sample(logits, rows)
    again = sample(logits, [SamplingRow(r.params, r.token_ids, make_generator(r.params.seed, "cuda"), 2) for r in rows])
    assert out == again and out[0] == [int(logits[0].float().argmax())] * 2


# ---- OpenAI's penalties, min-p and min_tokens ---------------------------------------------------------
def test_presence_and_frequency_penalties_subtract_per_output_token_as_openai_defines():
    vocab = 8
    logits = torch.zeros(1, vocab)
    logits[0, 3] = 2.0  # the favourite, already said twice in the output
    logits[0, 5] = 1.5  # said once in the prompt only: never penalized
    prompt, output = [5, 5], [3, 3, 1]
    params = dict(temperature=0.0, presence_penalty=0.3, frequency_penalty=0.4)
    plain = SamplingRow(SamplingParams(temperature=0.0), prompt + output, None, num_prompt_tokens=len(prompt))
    penalized = SamplingRow(SamplingParams(**params), prompt + output, None, num_prompt_tokens=len(prompt))
    assert sample(logits, [plain]) == [[3]]
    # 3: 2.0 - 0.3 - 2 * 0.4 = 0.9 < 1.5 (5, untouched), so 5 wins; token 1: 0 - 0.3 - 0.4.
    assert sample(logits, [penalized]) == [[5]]
    assert logits[0, 3] == 2.0  # the caller's logits are left as they were
    # The same shift seen through the distribution: frequencies follow softmax(logits - penalty).
    shifted = logits.clone()
    shifted[0, 3] -= 0.3 + 2 * 0.4
    shifted[0, 1] -= 0.3 + 0.4
    rows = [SamplingRow(SamplingParams(temperature=1.0, presence_penalty=0.3, frequency_penalty=0.4, seed=7),
                        prompt + output, make_generator(7), num_samples=20_000, num_prompt_tokens=len(prompt))]
    assert_matches_distribution(sample(logits, rows)[0], shifted[0].softmax(-1))


def test_negative_penalties_encourage_repeats():
    logits = torch.tensor([[1.0, 0.0, 0.5]])
    row = SamplingRow(SamplingParams(temperature=0.0, frequency_penalty=-1.5), [9, 1], None, num_prompt_tokens=1)
    assert sample(logits, [row]) == [[1]]


def test_min_p_keeps_tokens_at_least_min_p_times_as_likely_as_the_top_one():
    probs = torch.tensor([0.5, 0.3, 0.12, 0.05, 0.03])
    logits = probs.log().unsqueeze(0)
    rows = [SamplingRow(SamplingParams(temperature=1.0, min_p=0.2, seed=3), [], make_generator(3), num_samples=20_000)]
    kept = torch.where(probs >= 0.2 * 0.5, probs, torch.zeros(()))  # 0.5, 0.3, 0.12 stay
    assert_matches_distribution(sample(logits, rows)[0], kept / kept.sum())


def test_min_p_applies_after_the_temperature_like_vllm():
    logits = torch.tensor([[2.0, 1.0, 0.0]])
    # At temperature 0.5 the odds of token 1 against token 0 are e^-2 = 0.135 < min_p 0.2: only 0 is left.
    rows = [SamplingRow(SamplingParams(temperature=0.5, min_p=0.2, seed=1), [], make_generator(1), num_samples=500)]
    assert set(sample(logits, rows)[0]) == {0}


def test_banned_tokens_are_never_sampled_greedy_or_not():
    logits = torch.tensor([[5.0, 1.0, 0.0, -1.0]])
    for params in (SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, seed=2)):
        row = SamplingRow(params, [], make_generator(params.seed), num_samples=200, banned_token_ids=frozenset({0}))
        assert 0 not in sample(logits, [row])[0]
