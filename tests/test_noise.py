"""Counter-based sampling noise (mtplx/kernels/noise.py, ``sampling.NoiseStream``).

Philox4x32-10 against the known-answer vectors Random123 publishes (kat_vectors, "philox4x32
10"); every fill path (the C++ kernel, PyTorch, Triton on a CUDA device) against the PyTorch
words; what a fill depends on (its key, its index, the element: not its size, the rows beside it
or the fills before it); the numbers' distribution (chi-square of the uniforms' bins, a
Kolmogorov-Smirnov test of the exponentials, their ranges).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.stats import chisquare, kstest

from mtplx.engine.sampling import NoiseStream, exponential_, uniform_
from mtplx.kernels import cpu as cpu_kernels
from mtplx.kernels import noise

WORD = 0xFFFFFFFF
# (counter, key, output) from Random123's kat_vectors
KNOWN_ANSWERS = [
    ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((WORD,) * 4, (WORD, WORD), (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
     (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)),
]
KEYS = [noise.signed_key(k) for k in (0, 7, 2 ** 63 + 5, 2 ** 64 - 1, 123456789012345)]


@pytest.mark.parametrize("counter,key,want", KNOWN_ANSWERS)
def test_philox_matches_the_published_known_answers(counter, key, want):
    t = lambda v: torch.tensor(v, dtype=torch.int64)  # noqa: E731
    got = noise.philox(tuple(t(c) for c in counter), tuple(t(k) for k in key))
    assert [int(x) for x in got] == list(want)


def reference(keys: torch.Tensor, fills: torch.Tensor, n: int, exponential: bool) -> torch.Tensor:
    """The fills from PyTorch's words, in float64 for the logarithm."""
    u = noise.uniforms_of(noise.words(keys, fills, n)).double()
    return -u.log() if exponential else u


def fills_for(rows: int, per_row: int) -> torch.Tensor:
    """Fill indices of every kind: small, beyond 2**32, and the negative ones idle rows use."""
    pool = [0, 1, 2, 3, 2 ** 33 + 5, -1, -2, 40]
    return torch.tensor([[pool[(r * per_row + f) % len(pool)] for f in range(per_row)] for r in range(rows)])


@pytest.mark.parametrize("exponential", [False, True])
@pytest.mark.parametrize("n", [1, 5, 64, 1001, 4097, 8195])
@pytest.mark.parametrize("threads", [1, 2])
def test_every_fill_path_gives_the_reference_numbers(exponential, n, threads, monkeypatch):
    """The C++ kernel (where it builds; a fill cut into chunks of 1,024 counters across threads:
    n past one and two chunks) and the PyTorch path: uniforms bit for bit, exponentials to
    float32's rounding, into rows with strides of their own (a view of a wider buffer)."""
    keys = torch.tensor(KEYS)
    fills = fills_for(len(KEYS), 3)
    want = reference(keys, fills, n, exponential)
    paths = [True, False] if cpu_kernels.available() else [False]
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        check_paths(paths, keys, fills, n, exponential, want, monkeypatch)
    finally:
        torch.set_num_threads(saved)


def assert_untouched(buffer: torch.Tensor, n: int) -> None:
    """A fill into buffer[:, 1:, 2: n + 2] left the rest of the buffer (filled with -7) as it was."""
    assert bool((buffer[:, 0] == -7).all() and (buffer[:, :, :2] == -7).all() and (buffer[:, :, n + 2:] == -7).all())


def check_paths(paths, keys, fills, n, exponential, want, monkeypatch):
    for compiled in paths:
        monkeypatch.setattr(cpu_kernels, "available", lambda compiled=compiled: compiled)
        buffer = torch.full((len(KEYS), 4, n + 3), -7.0)
        out = noise.fill(buffer[:, 1:, 2: n + 2], keys, fills, exponential)
        assert out.data_ptr() == buffer[:, 1:, 2:].data_ptr()
        if exponential:
            assert torch.allclose(out.double(), want, rtol=2e-7, atol=0), compiled
        else:
            assert torch.equal(out, want.float()), compiled
        assert_untouched(buffer, n)


def test_a_fill_depends_on_its_key_index_and_element_only():
    keys, fills = torch.tensor([KEYS[1]]), torch.tensor([[9]])
    long = noise.fill(torch.empty(1, 1, 1000), keys, fills, exponential=False)
    short = noise.fill(torch.empty(1, 1, 37), keys, fills, exponential=False)
    assert torch.equal(short, long[:, :, :37])  # not on its size
    beside = noise.fill(torch.empty(3, 2, 1000), torch.tensor([KEYS[0], KEYS[1], KEYS[2]]),
                        torch.tensor([[1, 2], [4, 9], [9, 9]]), exponential=False)
    assert torch.equal(beside[1, 1], long[0, 0])  # not on the rows beside it
    assert not torch.equal(beside[2, 0], long[0, 0]) and not torch.equal(beside[1, 0], long[0, 0])
    first, second = NoiseStream(5), NoiseStream(5)
    a = [uniform_(torch.empty(10), first) for _ in range(3)]
    uniform_(torch.empty(500), second)  # a fill of another size first: the next ones are the same
    assert torch.equal(uniform_(torch.empty(10), second), a[1])
    assert torch.equal(uniform_(torch.empty(4), second), a[2][:4])
    assert second.fills == first.fills == 3


def test_the_extreme_words_give_uniforms_inside_the_interval_and_positive_exponentials():
    """The largest word once gave exactly 1.0 (a 24-bit step plus a half needs 25 bits): an
    exponential of 0, and a zero-probability token's 0 / 0 won its race as NaN."""
    u = noise.uniforms_of(torch.tensor([0, 1, 511, 512, 2 ** 31, 2 ** 32 - 513, 2 ** 32 - 1]))
    assert float(u.min()) == 2.0 ** -24 and float(u.max()) == 1 - 2.0 ** -24
    assert bool((-u.log() > 0).all()) and bool(((u.double() * 2 ** 24) % 2 == 1).all())  # exact odd multiples


def test_uniforms_are_uniform_in_the_open_interval_and_exponentials_exponential():
    u = uniform_(torch.empty(400_000), NoiseStream(1))
    assert float(u.min()) > 0 and float(u.max()) < 1
    counts = torch.histc(u, bins=64, min=0, max=1).numpy()
    assert chisquare(counts, np.full(64, len(u) / 64)).pvalue > 0.001
    # consecutive pairs: no dependence between neighbours (8 x 8 bins)
    pairs = (u[0::2] * 8).long() * 8 + (u[1::2] * 8).long()
    assert chisquare(torch.bincount(pairs, minlength=64).numpy(), np.full(64, len(pairs) / 64)).pvalue > 0.001
    e = exponential_(torch.empty(400_000), NoiseStream(2))
    assert kstest(e.double().numpy(), "expon").pvalue > 0.001
    assert float(e.min()) > 0 and float(e.max()) < 16.7


def test_streams_with_a_seed_repeat_and_without_one_differ():
    assert NoiseStream(3).key == NoiseStream(3).key == 3 and NoiseStream(-1).key == 2 ** 64 - 1
    assert NoiseStream().key != NoiseStream().key
    stream = NoiseStream(0)
    assert [stream.take(), stream.take(2), stream.take()] == [0, 1, 3] and stream.fills == 4


@pytest.mark.skipif(not (torch.cuda.is_available() and noise.triton is not None), reason="needs CUDA and Triton")
@pytest.mark.parametrize("exponential", [False, True])
def test_the_triton_kernel_gives_the_reference_numbers(exponential):
    keys = torch.tensor(KEYS)
    fills = fills_for(len(KEYS), 3)
    for n in (1, 7, 4096, 4097, 49_152):
        want = reference(keys, fills, n, exponential)
        buffer = torch.full((len(KEYS), 4, n + 3), -7.0, device="cuda")
        got = noise.fill(buffer[:, 1:, 2: n + 2], keys.cuda(), fills.cuda(), exponential).cpu()
        if exponential:
            assert torch.allclose(got.double(), want, rtol=2e-7, atol=0), n
        else:
            assert torch.equal(got, want.float()), n
        assert_untouched(buffer, n)
