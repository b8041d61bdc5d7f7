"""Specification of mtplx.engine.sampling: parameter validation, logits processing, sampling."""

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy.stats import chisquare, kstest

from mtplx.engine.sampling import (
    SamplerBatch,
    SamplingParams,
    apply_penalties,
    exponential_,
    logits_to_probs,
    NoiseStream,
    sample,
)
from mtplx.errors import InvalidParameter


def kept(probs: torch.Tensor) -> list[list[int]]:
    """Indices with non-zero probability, per row."""
    return [torch.nonzero(row).flatten().tolist() for row in probs]


# --- validation -----------------------------------------------------------------------------

@pytest.mark.parametrize(
    "field, value",
    [
        ("temperature", -0.1),
        ("temperature", math.inf),
        ("temperature", math.nan),
        ("temperature", "hot"),
        ("top_p", -0.1),
        ("top_p", 1.5),
        ("top_p", math.nan),
        ("top_k", -1),
        ("top_k", 2.5),
        ("top_k", True),
        ("min_p", -0.01),
        ("min_p", 1.01),
        ("presence_penalty", 2.5),
        ("presence_penalty", -2.01),
        ("frequency_penalty", 3.0),
        ("frequency_penalty", math.nan),
        ("seed", 1.5),
        ("seed", "42"),
        ("seed", True),
    ],
)
def test_validate_rejects_out_of_range_values_naming_the_parameter(field, value):
    with pytest.raises(InvalidParameter) as error:
        SamplingParams(**{field: value}).validate()
    assert error.value.param == field
    assert field in str(error.value)


def test_top_p_0_keeps_the_most_probable_token_alone():
    """OpenAI's top_p range is [0, 1]; 0 means the top token alone, which is top-k 1 (the
    nucleus of mass 0 would be empty)."""
    params = SamplingParams(temperature=0.8, top_p=0, top_k=40).validate()
    assert (params.top_p, params.top_k) == (1.0, 1)
    probs = logits_to_probs(torch.tensor([[0.5, 2.0, 1.0]]), params)
    assert probs.tolist() == [[0.0, 1.0, 0.0]]


def test_validate_rejects_top_k_above_the_vocabulary():
    SamplingParams(top_k=10).validate(vocab_size=10)
    with pytest.raises(InvalidParameter) as error:
        SamplingParams(top_k=11).validate(vocab_size=10)
    assert error.value.param == "top_k" and "10" in str(error.value)


def test_validate_accepts_boundary_values_and_returns_the_params():
    params = SamplingParams(temperature=0.0, top_p=1.0, top_k=0, min_p=1.0,
                            presence_penalty=-2.0, frequency_penalty=2.0, seed=-7)
    assert params.validate(vocab_size=5) is params
    assert params.greedy and not SamplingParams(temperature=0.7).greedy


# --- penalties ------------------------------------------------------------------------------

def test_zero_penalties_return_the_input_unchanged():
    logits = torch.randn(3, 7, generator=torch.Generator().manual_seed(0))
    counts = torch.randint(0, 4, (3, 7), generator=torch.Generator().manual_seed(1))
    assert apply_penalties(logits, counts, 0.0, 0.0) is logits
    zero_rows = torch.zeros(3)
    assert torch.equal(apply_penalties(logits, counts, zero_rows, zero_rows), logits)


def test_presence_and_frequency_penalties_follow_openai_formula():
    logits = torch.tensor([[1.0, 2.0, 3.0, 4.0]])
    counts = torch.tensor([[0, 1, 3, 0]])
    out = apply_penalties(logits, counts, presence_penalty=0.5, frequency_penalty=0.25)
    # logit - presence * (count > 0) - frequency * count
    assert torch.allclose(out, torch.tensor([[1.0, 2.0 - 0.5 - 0.25, 3.0 - 0.5 - 0.75, 4.0]]))


def test_penalties_can_differ_per_row_and_zero_rows_stay_bit_identical():
    logits = torch.tensor([[1.0, 2.0, 3.0], [0.1, 0.2, 0.3]])
    counts = torch.tensor([[2, 0, 1], [2, 0, 1]])
    out = apply_penalties(logits, counts, torch.tensor([1.0, 0.0]), torch.tensor([-0.5, 0.0]))
    assert torch.allclose(out[0], torch.tensor([1.0 - 1.0 + 1.0, 2.0, 3.0 - 1.0 + 0.5]))
    assert torch.equal(out[1], logits[1])


# --- processing -----------------------------------------------------------------------------

def test_greedy_params_give_a_one_hot_of_the_first_argmax():
    logits = torch.tensor([[0.1, 3.0, 3.0, -1.0], [5.0, 1.0, 2.0, 5.0]])
    probs = logits_to_probs(logits, SamplingParams(temperature=0.0))
    assert probs.dtype == torch.float32
    assert torch.equal(probs, torch.tensor([[0.0, 1.0, 0.0, 0.0], [1.0, 0.0, 0.0, 0.0]]))


def test_temperature_scales_logits_before_softmax():
    logits = torch.tensor([[1.0, 2.0, 0.5]])
    probs = logits_to_probs(logits, SamplingParams(temperature=0.5))
    assert torch.allclose(probs, torch.softmax(logits / 0.5, dim=-1))


def test_tiny_temperature_concentrates_on_the_argmax_without_nans():
    probs = logits_to_probs(torch.tensor([[40.0, 39.0, -1e4]]), SamplingParams(temperature=1e-30))
    assert torch.equal(probs, torch.tensor([[1.0, 0.0, 0.0]]))


def test_top_k_keeps_the_k_largest_logits():
    logits = torch.tensor([[0.0, 5.0, 1.0, 4.0, 2.0], [3.0, 2.0, 1.0, 0.0, -1.0]])
    probs = logits_to_probs(logits, SamplingParams(temperature=1.0, top_k=2))
    assert kept(probs) == [[1, 3], [0, 1]]
    expected = torch.softmax(torch.tensor([5.0, 4.0]), dim=-1)
    assert torch.allclose(probs[0, [1, 3]], expected)


def test_top_p_keeps_the_smallest_set_reaching_the_mass():
    probs_in = torch.tensor([[0.05, 0.5, 0.25, 0.15, 0.05]])
    logits = probs_in.log()
    # sorted: 0.5, 0.25, 0.15, 0.05, 0.05 -> cumulative 0.5, 0.75, 0.9, ...
    assert kept(logits_to_probs(logits, SamplingParams(temperature=1.0, top_p=0.4))) == [[1]]
    assert kept(logits_to_probs(logits, SamplingParams(temperature=1.0, top_p=0.6))) == [[1, 2]]
    probs = logits_to_probs(logits, SamplingParams(temperature=1.0, top_p=0.8))
    assert kept(probs) == [[1, 2, 3]]
    assert torch.allclose(probs[0, [1, 2, 3]], torch.tensor([0.5, 0.25, 0.15]) / 0.9)


def test_top_p_applies_to_the_top_k_renormalised_distribution():
    logits = torch.tensor([[0.4, 0.3, 0.2, 0.1]]).log()
    # top_k=2 leaves 4/7, 3/7; top_p=0.5 then needs only the first.
    probs = logits_to_probs(logits, SamplingParams(temperature=1.0, top_k=2, top_p=0.5))
    assert kept(probs) == [[0]]


def test_min_p_drops_tokens_below_a_fraction_of_the_top_probability():
    logits = torch.tensor([[0.5, 0.3, 0.15, 0.05]]).log()
    probs = logits_to_probs(logits, SamplingParams(temperature=1.0, min_p=0.3))  # threshold 0.15
    assert kept(probs) == [[0, 1, 2]]
    assert torch.allclose(probs.sum(), torch.tensor(1.0))


@settings(max_examples=60, deadline=None, derandomize=True)
@given(
    seed=st.integers(0, 2**31),
    temperature=st.floats(0.01, 5.0),
    top_k=st.integers(0, 8),
    top_p=st.floats(1e-6, 1.0),
    min_p=st.floats(0.0, 1.0),
)
def test_filters_never_remove_every_token_and_always_keep_the_argmax(seed, temperature, top_k, top_p, min_p):
    logits = torch.randn(4, 8, generator=torch.Generator().manual_seed(seed)) * 4
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p).validate(8)
    probs = logits_to_probs(logits, params)
    assert torch.all(probs >= 0)
    assert torch.allclose(probs.sum(dim=-1), torch.ones(4))
    top = probs.gather(-1, logits.argmax(dim=-1, keepdim=True))
    assert torch.all(top > 0)


# --- noise streams and sampling ----------------------------------------------------------------

PROBS = torch.tensor([0.4, 0.25, 0.15, 0.1, 0.06, 0.04, 0.0])


def test_same_seed_gives_same_samples_and_different_seeds_differ():
    probs = PROBS.expand(200, -1)
    first = sample(probs, NoiseStream(123))
    again = sample(probs, NoiseStream(123))
    other = sample(probs, NoiseStream(124))
    assert torch.equal(first, again)
    assert not torch.equal(first, other)


def test_unseeded_streams_differ():
    probs = PROBS.expand(200, -1)
    assert not torch.equal(sample(probs, NoiseStream(None)), sample(probs, NoiseStream(None)))


def test_sample_frequencies_match_probs_chi_square():
    n = 50_000
    tokens = sample(PROBS.expand(n, -1), NoiseStream(7))
    assert tokens.dtype == torch.long and tokens.shape == (n,)
    counts = torch.bincount(tokens, minlength=len(PROBS)).numpy()
    assert counts[-1] == 0  # a zero-probability token is never drawn
    expected = PROBS[:-1].double().numpy() * n
    assert chisquare(counts[:-1], expected).pvalue > 0.001


def test_sample_accepts_unnormalised_weights():
    weights = torch.tensor([3.0, 1.0, 0.0]).expand(40_000, -1)
    counts = torch.bincount(sample(weights, NoiseStream(3)), minlength=3).numpy()
    assert counts[2] == 0
    assert chisquare(counts[:2], np.array([0.75, 0.25]) * 40_000).pvalue > 0.001


def test_race_noise_is_exponential_never_zero_and_fixed_by_the_seed():
    """A stream's exponential fills (-log of Philox uniforms, kernels/noise.py): Exp(1) by a
    Kolmogorov-Smirnov test against scipy's exponential, no draw of 0 (it would hand the race to
    any token), the same draws for the same seed, filled in place (a view of a larger buffer too)."""
    draws = exponential_(torch.empty(400_000), NoiseStream(5))
    assert kstest(draws.double().numpy(), "expon").pvalue > 0.001
    assert float(draws.min()) > 0 and bool(torch.isfinite(draws).all())
    buffer = torch.zeros(3, 1000)
    out = exponential_(buffer[1], NoiseStream(9))
    assert out.data_ptr() == buffer[1].data_ptr()
    assert torch.equal(buffer[1], exponential_(torch.empty(1000), NoiseStream(9)))
    assert bool((buffer[0] == 0).all() and (buffer[2] == 0).all())


# --- on the GPU -----------------------------------------------------------------------------

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@needs_cuda
def test_processing_and_sampling_never_sync_with_the_host_on_cuda():
    generator = NoiseStream(0)
    logits = torch.randn(4, 1000, device="cuda")
    counts = torch.randint(0, 3, (4, 1000), device="cuda")
    per_row = torch.tensor([0.0, 0.5, 1.0, -1.0], device="cuda")
    params = SamplingParams(temperature=0.8, top_k=50, top_p=0.9, min_p=0.05)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        penalised = apply_penalties(apply_penalties(logits, counts, 0.5, 0.25), counts, per_row, per_row)
        tokens = sample(logits_to_probs(penalised, params), generator)
        greedy = logits_to_probs(penalised, SamplingParams())
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert tokens.shape == (4,) and torch.equal(greedy.argmax(-1), penalised.argmax(-1))


@needs_cuda
def test_sample_frequencies_match_probs_on_cuda():
    n = 50_000
    tokens = sample(PROBS.cuda().expand(n, -1), NoiseStream(7))
    counts = torch.bincount(tokens, minlength=len(PROBS)).cpu().numpy()
    assert counts[-1] == 0
    assert chisquare(counts[:-1], PROBS[:-1].double().numpy() * n).pvalue > 0.001


@pytest.mark.parametrize("compiled", [False, True])
@pytest.mark.parametrize("temperature,top_p", [(0.3, 0.95), (0.7, 0.95), (1.0, 0.9), (1.0, 0.999), (2.0, 0.95),
                                               (1.0, 0.5), (5.0, 0.99)])
def test_top_p_from_a_partial_sort_keeps_what_a_sort_of_every_token_keeps(temperature, top_p, compiled, monkeypatch):
    """On the CPU top-p reads the largest probabilities first and sorts the whole vocabulary only
    where their mass falls short: through PyTorch's ops the result is bit-identical to the
    nucleus written out with a full sort (mass strictly before each token below top_p, at least
    one kept); through the C++ kernels (``kernels.cpu.process_probs``, its own exp and sums) the
    same tokens are kept, the probabilities within float32 rounding. Peaked and flat
    distributions over a 49,152-token vocabulary, rows of different settings in one batch."""
    from mtplx.engine.sampling import SamplerTensors, process_logits
    from mtplx.kernels import cpu as cpu_kernels

    if compiled and not cpu_kernels.available():
        pytest.skip("the CPU kernels are not built here")
    if not compiled:
        monkeypatch.setattr(cpu_kernels, "sampling_usable", lambda *a: False)
    logits = torch.randn(3, 2, 49152, generator=torch.Generator().manual_seed(5)) * 4
    logits[1] = torch.randn(2, 49152, generator=torch.Generator().manual_seed(6))  # flatter rows
    s = SamplerTensors(3, torch.device("cpu"))
    s.write([SamplingParams(temperature=temperature, top_p=top_p), SamplingParams(temperature=temperature, top_p=top_p),
             SamplingParams(temperature=temperature, top_p=1.0)])
    got = process_logits(logits, s, top_k=False, min_p=False, greedy=False)
    probs = torch.softmax((logits - logits.amax(-1, keepdim=True)) / temperature, dim=-1)
    ordered = torch.sort(probs, dim=-1, descending=True).values
    n_keep = ((torch.cumsum(ordered, -1) - ordered) < top_p).sum(-1, keepdim=True).clamp(min=1)
    kept = probs.masked_fill(probs < ordered.gather(-1, n_keep - 1), 0.0)
    expected = kept / kept.sum(-1, keepdim=True)
    if compiled:  # a token kept by one side only must sit on the boundary (its mass before ~ top_p)
        want = torch.cat([expected[:2], probs[2:]])
        exact = torch.softmax((logits.double() - logits.double().amax(-1, keepdim=True)) / temperature, dim=-1)
        for r, i, v in ((got > 0) != (want > 0)).nonzero().tolist():
            before = float(exact[r, i][exact[r, i] > exact[r, i, v]].sum())
            assert r < 2 and abs(before - top_p) < 1e-5, (r, i, v, before)
        both = (got > 0) & (want > 0)
        # within float32 rounding (both ~7e-6 of float64) once each row is normalized over the tokens
        # both kept (a boundary token kept by one side only scales that side's row by its mass)
        def common(p):
            q = torch.where(both, p, 0.0).double()
            return (q / q.sum(-1, keepdim=True))[both]
        torch.testing.assert_close(common(got), common(want), rtol=1e-5, atol=1e-12)
        return
    assert torch.equal(got[:2], expected[:2])
    assert torch.equal(got[2], probs[2])
    for row in range(2):
        single = logits_to_probs(logits[row], SamplingParams(temperature=temperature, top_p=top_p))
        assert torch.equal(single, expected[row])


@pytest.mark.parametrize("compiled", [False, True])
def test_top_k_and_min_p_in_a_batch_keep_what_each_rows_own_processing_keeps(compiled, monkeypatch):
    """Rows asking for different top-k (none, 1, 20, 500; with and without top-p and min-p; a
    greedy row) in one batch over a 49,152-token vocabulary with tied logits: each row keeps the
    tokens ``logits_to_probs`` keeps for it alone. Through PyTorch's ops the probabilities are
    its own; through the C++ kernels (the cut, ``kernels.cpu.process_probs``, then min-p) within
    float32 rounding (no token here lies within a rounding of a threshold, where they may part)."""
    from mtplx.engine.sampling import SamplerTensors, process_logits
    from mtplx.kernels import cpu as cpu_kernels

    if compiled and not cpu_kernels.available():
        pytest.skip("the CPU kernels are not built here")
    if not compiled:
        monkeypatch.setattr(cpu_kernels, "sampling_usable", lambda *a: False)
    logits = torch.round(torch.randn(7, 2, 49152, generator=torch.Generator().manual_seed(8)) * 8) / 2  # ties
    params = [SamplingParams(temperature=0.7, top_k=20), SamplingParams(temperature=1.0, top_k=1),
              SamplingParams(temperature=0.7, top_k=500, top_p=0.9), SamplingParams(temperature=0.8, top_p=0.95),
              SamplingParams(), SamplingParams(temperature=1.0, min_p=0.05),
              SamplingParams(temperature=1.5, top_k=40, top_p=0.9, min_p=0.2)]
    s = SamplerTensors(7, torch.device("cpu"))
    s.write(params)
    got = process_logits(logits, s)
    for row, p in enumerate(params):
        want = logits_to_probs(logits[row], p)
        assert torch.equal(got[row] > 0, want > 0), row
        if compiled:
            torch.testing.assert_close(got[row], want, rtol=1e-5, atol=1e-12)
        else:
            assert torch.equal(got[row], want), row
    assert int((got[0, 0] > 0).sum()) >= 20 and int((got[1] > 0).sum(-1).max()) >= 1


def test_a_batch_draws_each_row_as_that_row_alone_and_greedy_rows_take_the_argmax():
    """SamplerBatch.sample races every row at once, each row's noise from its own stream: the
    tokens ``sample`` gives each row alone from a stream of the same seed, step after step."""
    params = [SamplingParams(temperature=t) for t in (0.0, 0.7, 1.0, 0.0, 1.3)]
    gens = [NoiseStream(100 + r) for r in range(len(params))]
    alone = [NoiseStream(100 + r) for r in range(len(params))]
    batch = SamplerBatch(params, gens, torch.device("cpu"))
    logits = torch.randn(len(params), 300, generator=torch.Generator().manual_seed(5))
    for _ in range(20):
        probs = batch.probs(logits)
        picks = batch.sample(probs).tolist()
        for r, p in enumerate(params):
            want = probs[r].argmax().item() if p.greedy else sample(probs[r:r + 1], alone[r]).item()
            assert picks[r] == want
    assert len({tuple(batch.sample(batch.probs(logits)).tolist()) for _ in range(5)}) > 1
