"""Sampling parameters, logits processing and seeded sampling.

Processing order (``apply_penalties`` first, done by the caller with the row's token counts,
then ``logits_to_probs``):

1. presence / frequency penalties (OpenAI convention) on raw logits;
2. temperature scaling (temperature 0 means greedy: a one-hot of the argmax, nothing else);
3. top-k: keep tokens whose logit is >= the k-th largest (ties at the k-th value are kept);
4. top-p: keep the smallest high-probability set whose mass reaches top_p (computed on the
   top-k renormalised distribution; ties at the boundary are kept; the top token always is);
5. min-p: drop tokens whose probability is below min_p * the highest probability;
6. renormalise.

Every step keeps the most probable token, so no filter can leave a row empty. Everything is
vectorised over rows and stays on the tensors' device: no host syncs.

Speculative decoding is exact for any draft distribution q, as long as the draft is sampled
from q and q is what its acceptance reads (u < p(x) / q(x), then the residual max(0, p - q)).
Argmax drafts are q one-hot. Mirror drafts (``draft_params``) are sampled from the head's logits
at a sharpened temperature without the request's filters: they accept as often as the head
processed exactly like the target, and need no top-p threshold search on every draft.
"""

from __future__ import annotations

import math
import secrets
from dataclasses import dataclass

import torch

from mtplx.errors import InvalidParameter
from mtplx.kernels import cpu as cpu_kernels
from mtplx.kernels import noise
from mtplx.kernels import sampling as sampling_kernels

PENALTY_RANGE = (-2.0, 2.0)  # OpenAI's allowed range for presence/frequency penalties
SEED_RANGE = (-2 ** 63, 2 ** 64)  # int64 and uint64 seeds; a negative one is taken as its 64 bits


@dataclass(frozen=True)
class SamplingParams:
    """One request's sampler settings. ``temperature == 0`` means greedy decoding."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None

    def __post_init__(self) -> None:
        # top_p 0 (OpenAI's range is [0, 1]) keeps the most probable token alone: top-k 1
        if self.top_p == 0 and not isinstance(self.top_p, bool):
            object.__setattr__(self, "top_p", 1.0)
            object.__setattr__(self, "top_k", 1)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0

    def validate(self, vocab_size: int | None = None) -> SamplingParams:
        """Raise ``InvalidParameter`` naming the first bad field; return self when all are fine."""
        _check_number("temperature", self.temperature)
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise InvalidParameter("temperature", f"must be a finite number >= 0 (0 = greedy), got {self.temperature}")
        _check_number("top_p", self.top_p)
        if not (0 < self.top_p <= 1):  # (0 was made top-k 1)
            raise InvalidParameter("top_p", f"must be in [0, 1], got {self.top_p}")
        _check_top_k(self.top_k, vocab_size)
        _check_number("min_p", self.min_p)
        if not (0 <= self.min_p <= 1):
            raise InvalidParameter("min_p", f"must be in [0, 1], got {self.min_p}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check_number(name, value)
            if not (PENALTY_RANGE[0] <= value <= PENALTY_RANGE[1]):
                raise InvalidParameter(name, f"must be in [-2, 2], got {value}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise InvalidParameter("seed", f"must be an integer or null, got {self.seed!r}")
        if self.seed is not None and not (SEED_RANGE[0] <= self.seed < SEED_RANGE[1]):
            raise InvalidParameter("seed", f"must be a 64-bit integer, from -2**63 to 2**64 - 1 (a negative seed is "
                                           f"its 64 bits: -1 is 2**64 - 1), got {self.seed}")
        return self


def _check_number(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidParameter(name, f"must be a number, got {value!r}")


def _check_top_k(top_k: object, vocab_size: int | None) -> None:
    if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 0:
        raise InvalidParameter("top_k", f"must be an integer >= 0 (0 = off), got {top_k!r}")
    if vocab_size is not None and top_k > vocab_size:
        raise InvalidParameter("top_k", f"must be at most the vocabulary size {vocab_size}, got {top_k}")


def apply_penalties(
    logits: torch.Tensor,
    counts: torch.Tensor,
    presence_penalty: float | torch.Tensor = 0.0,
    frequency_penalty: float | torch.Tensor = 0.0,
) -> torch.Tensor:
    """Presence and frequency penalties, OpenAI convention.

    logits: [rows, V] float; counts: [rows, V] int, how often each token occurred in the row's
    context (prompt and output so far, as the caller defines it). Penalties are floats or
    per-row tensors [rows]. Returns ``logits - presence * (counts > 0) - frequency * counts``.

    With both penalties the float 0 the input tensor itself is returned (no arithmetic). Rows
    whose tensor penalties are 0 come out bit-identical too, since x - 0 == x exactly.
    """
    out = logits
    if _maybe_nonzero(presence_penalty):
        out = out - _per_row(presence_penalty, out) * (counts > 0).to(out.dtype)
    if _maybe_nonzero(frequency_penalty):
        out = out - _per_row(frequency_penalty, out) * counts.to(out.dtype)
    return out


def _maybe_nonzero(penalty: float | torch.Tensor) -> bool:
    # A tensor's values would need a host sync to inspect, so tensors always take the arithmetic path.
    return isinstance(penalty, torch.Tensor) or penalty != 0


def _per_row(penalty: float | torch.Tensor, logits: torch.Tensor) -> float | torch.Tensor:
    if isinstance(penalty, torch.Tensor):
        return penalty.to(device=logits.device, dtype=logits.dtype).unsqueeze(-1)
    return penalty


def logits_to_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Processed next-token distribution: logits [rows, V] -> probs [rows, V] float32.

    Applies temperature, top-k, top-p, min-p in that order and renormalises (see the module
    docstring). Greedy params give a one-hot of the argmax, ties toward the lowest index.
    Penalties are not applied here: call ``apply_penalties`` on the logits first.
    """
    logits = logits.float()
    if params.greedy:
        return one_hot_argmax(logits)
    # Subtracting the row max first keeps tiny temperatures from overflowing to inf.
    scaled = (logits - logits.amax(dim=-1, keepdim=True)) / params.temperature
    if 0 < params.top_k < logits.shape[-1]:
        scaled = _keep_top_k(scaled, params.top_k)
    probs = torch.softmax(scaled, dim=-1)
    if params.top_p < 1:
        probs = _keep_top_p(probs, params.top_p)
    if params.min_p > 0:
        probs = _keep_min_p(probs, params.min_p)
    return probs


def one_hot_argmax(logits: torch.Tensor) -> torch.Tensor:
    """[rows, V] -> float32 one-hot [rows, V] of the argmax (first maximum, as torch.argmax)."""
    winners = logits.argmax(dim=-1, keepdim=True)
    return torch.zeros(logits.shape, dtype=torch.float32, device=logits.device).scatter_(-1, winners, 1.0)


def _keep_top_k(logits: torch.Tensor, top_k: int) -> torch.Tensor:
    kth_largest = torch.topk(logits, top_k, dim=-1).values[..., -1:]
    return logits.masked_fill(logits < kth_largest, float("-inf"))


def _keep_top_p(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Keep the smallest set of most probable tokens whose mass is >= top_p, then renormalise."""
    # A token is needed while the mass strictly before it is still short of top_p; the first
    # token has 0 before it, so at least one is always kept.
    threshold = _nucleus_threshold(probs, probs.new_full((), top_p))  # a fill: no copy from the host
    return _renormalise(probs.masked_fill(probs < threshold, 0.0))


def _keep_min_p(probs: torch.Tensor, min_p: float) -> torch.Tensor:
    # min_p <= 1 keeps the most probable token.
    threshold = min_p * probs.amax(dim=-1, keepdim=True)
    return _renormalise(probs.masked_fill(probs < threshold, 0.0))


def _renormalise(weights: torch.Tensor) -> torch.Tensor:
    return weights / weights.sum(dim=-1, keepdim=True)


class NoiseStream:
    """A request's random numbers (``kernels.noise``: Philox4x32-10 keyed by the seed, a fresh
    64-bit key from the OS without one): a counter of the fills drawn so far. Every draw takes
    the next fill (``take``), whatever its size and wherever it is drawn (host path, a CUDA graph,
    beside other rows), so a seed fixes the output as long as each path draws the same fills in
    the same order: a mirror row's draft races, then the cycle's acceptance uniforms, then the
    emitted token's race."""

    def __init__(self, seed: int | None = None):
        self.key = secrets.randbits(64) if seed is None else seed % 2 ** 64  # a negative seed: its 64 bits
        self.fills = 0

    def take(self, n: int = 1) -> int:
        """The first of the next ``n`` fills (now drawn)."""
        first = self.fills
        self.fills += n
        return first


def draw_fill(out: torch.Tensor, stream: NoiseStream, exponential: bool) -> torch.Tensor:
    """Fill ``out`` (float32, contiguous) in place with the stream's next fill: uniforms in (0, 1),
    or Exp(1) draws (never 0, never infinite). Returns out."""
    keys = noise.indices([noise.signed_key(stream.key)], out.device)
    noise.fill(out.view(1, 1, -1), keys, noise.indices([[stream.take()]], out.device), exponential)
    return out


def exponential_(out: torch.Tensor, stream: NoiseStream) -> torch.Tensor:
    """Fill ``out`` in place with i.i.d. Exp(1) draws, the stream's next fill: the noise of an
    exponential race (``kernels.noise``: one launch on CUDA; 49,152 draws 0.10 ms on the CPU's C++
    kernel against 0.23 ms for float64 uniforms through PyTorch's generator, one AMD EPYC core).
    No draw is 0, which would hand the race to any token with p > 0, nor infinite."""
    return draw_fill(out, stream, exponential=True)


def uniform_(out: torch.Tensor, stream: NoiseStream) -> torch.Tensor:
    """Fill ``out`` in place with uniforms in (0, 1), the stream's next fill."""
    return draw_fill(out, stream, exponential=False)


def sample(probs: torch.Tensor, stream: NoiseStream) -> torch.Tensor:
    """Draw one token per row: probs [rows, V] (non-negative, need not sum to 1) -> [rows] long.

    Exponential race: with E_v ~ Exp(1) i.i.d., argmax_v p_v / E_v is v with probability
    p_v / sum(p) exactly (E_v / p_v ~ Exp(p_v), and the smallest of independent exponentials
    is the one with rate p_v with probability proportional to p_v). Tokens with p_v = 0 never
    win. It needs no host sync, unlike a CPU-side draw. E is the stream's next fill
    (``exponential_``, which never draws 0: E = 0 would hand the win to any token with p_v > 0).
    """
    return race_winners(probs, exponential_(torch.empty(probs.shape, dtype=torch.float32, device=probs.device),
                                            stream))


# A mirror row's draft distribution q: softmax of the head's logits (penalties and grammar masks
# applied) at DRAFT_SHARPENING times the request's temperature, no top-k / top-p / min-p.
# Expected depth-1 acceptance sum_x min(p(x), q(x)) of the default model's shipped head,
# teacher-forced on the trunk's own continuations (benchmarks/draft_distribution.py, 24 prompts x 128
# tokens): the scale was chosen on 24 training prompts (T 0.7, top-p 0.95: 0.6662 at 0.7, 0.6668
# at 0.8, 0.6639 at 0.9; T 1.0: 0.5486 at 0.8, 0.5504 at 0.9); on 24 held-out prompts q processed
# as the target (the request's own sampler) accepts 0.5423 at T 0.7 / 0.4681 at T 1.0, this
# one 0.5442 / 0.4745 (argmax drafts: 0.4861 / 0.3092), and top-p's threshold search cost the
# H200 about 45 us per draft against 17-19 us for a row without filters (kernels/sampling.py).
DRAFT_SHARPENING = 0.8


def draft_params(params: SamplingParams) -> SamplingParams:
    """The settings a mirror row's drafts are sampled with (``DRAFT_SHARPENING``); greedy rows
    keep theirs (an argmax). Penalties are applied to the logits by the caller, as for the target."""
    if params.greedy:
        return params
    return SamplingParams(temperature=params.temperature * DRAFT_SHARPENING)


def race_winners(probs: torch.Tensor, race: torch.Tensor) -> torch.Tensor:
    """argmax_v probs / race per row: every row's exponential race in one pass (``sample``);
    a row whose race is all ones takes its argmax."""
    return torch.argmax(probs / race, dim=-1)


class SamplerTensors:
    """Per-row sampler settings as [rows, 1] tensors on the device: what ``process_logits``
    reads. A CUDA cycle graph reads one set of these as static inputs (``write`` refills them in
    place when its rows change); ``SamplerBatch`` builds its own."""

    def __init__(self, rows: int, device: torch.device):
        column = lambda dtype, fill: torch.full((rows, 1), fill, dtype=dtype, device=device)  # noqa: E731
        self.greedy = column(torch.bool, True)
        self.temperature = column(torch.float32, 1.0)
        self.top_k = column(torch.long, 0)  # 0: off
        self.top_p = column(torch.float32, 1.0)
        self.min_p = column(torch.float32, 0.0)

    def write(self, params: list[SamplingParams]) -> None:
        """These rows' settings (rows past ``params``, a bucket's padding, become greedy)."""
        pad = self.greedy.shape[0] - len(params)
        rows = [(p.greedy, p.temperature or 1.0, p.top_k, p.top_p, p.min_p) for p in params]
        rows += [(True, 1.0, 0, 1.0, 0.0)] * pad
        for i, target in enumerate((self.greedy, self.temperature, self.top_k, self.top_p, self.min_p)):
            target.copy_(torch.tensor([[r[i]] for r in rows], dtype=target.dtype), non_blocking=True)


def process_logits(logits: torch.Tensor, s: SamplerTensors, top_k: bool = True, top_p: bool = True,
                   min_p: bool = True, greedy: bool = True) -> torch.Tensor:
    """``logits_to_probs`` for rows of different settings at once: logits [rows, positions, V]
    (penalties already applied) -> float32 probs [rows, positions, V], each row processed with
    its own temperature, top-k, top-p and min-p in that order, greedy rows a one-hot of the
    argmax. The flags skip a filter no row asks for (a CUDA graph takes them all: any row may);
    a row that does not ask for a filter is left unchanged by it. On CUDA one Triton kernel does
    it all (``kernels.sampling.process``), each row's filters only where it asks for them; on the
    CPU one C++ call (``kernels.cpu.process_probs``: the same kept tokens but where a token lies
    within float32 rounding of top-p's or min-p's threshold, probabilities within float32
    rounding of these ops'), after top-k's cut where a row asks for it (``_top_k_cut``) and
    before min-p's (``_min_p_rows``)."""
    if sampling_kernels.usable(logits):
        return sampling_kernels.process(logits, s.greedy, s.temperature, s.top_k, s.top_p, s.min_p)[0]
    if cpu_kernels.sampling_usable(logits):  # the CPU's one call (kernels/cpu.py)
        rows, positions, vocab = logits.shape
        if top_k:  # top-k's cut taken from the same scaled logits as below: the same kept tokens
            logits = logits.masked_fill(_top_k_cut(_scaled(logits, s.temperature), s.top_k), float("-inf"))
        per_token = lambda column: column.expand(rows, positions).reshape(-1)  # noqa: E731
        probs = cpu_kernels.process_probs(logits.reshape(-1, vocab), per_token(s.temperature), per_token(s.top_p),
                                          per_token(s.greedy)).view(rows, positions, vocab)
        return _min_p_rows(probs, s.min_p) if min_p else probs  # (a greedy row's one-hot stays one)
    logits = logits.float()
    scaled = _scaled(logits, s.temperature)
    if top_k:
        scaled = scaled.masked_fill(_top_k_cut(scaled, s.top_k), float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    if top_p:
        kept = _renormalise(probs.masked_fill(probs < _nucleus_threshold(probs, s.top_p[:, :, None]), 0.0))
        probs = torch.where(s.top_p[:, :, None] < 1, kept, probs)
    if min_p:
        probs = _min_p_rows(probs, s.min_p)
    if greedy:
        probs = torch.where(s.greedy[:, :, None], one_hot_argmax(logits), probs)
    return probs


def _scaled(logits: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    """logits [rows, positions, V] less their row's largest, over the row's temperature [rows, 1]."""
    return (logits - logits.amax(dim=-1, keepdim=True)) / temperature[:, :, None]


def _min_p_rows(probs: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """probs [rows, positions, V] with min-p applied to the rows whose min_p [rows, 1] is above
    0: tokens below min_p times their row's largest probability dropped, the rest renormalised
    (other rows unchanged)."""
    kept = _renormalise(probs.masked_fill(probs < min_p[:, :, None] * probs.amax(dim=-1, keepdim=True), 0.0))
    return torch.where(min_p[:, :, None] > 0, kept, probs)


def _top_k_cut(scaled: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    """Where top-k drops a token: scaled [rows, positions, V] below its row's k-th largest
    value (ties at it kept), for rows with top_k [rows, 1] above 0 (others keep every token).
    On CUDA the k-th value comes from a full sort (no host sync); on the CPU from ``torch.topk``
    of the largest k any row asks (the same sorted values up to there): a 49,152-token row's
    sort cost about 3.5 ms on this project's CPU, and top_k=20 halved decoding speed."""
    vocab = scaled.shape[-1]
    asks = (top_k > 0)[:, :, None]
    k = top_k.clamp(1, vocab)[:, :, None].expand(-1, scaled.shape[1], 1)
    if scaled.is_cuda or not scaled.numel():
        ordered = torch.sort(scaled, dim=-1, descending=True).values
    else:
        ordered = torch.topk(scaled, int(k.max()), dim=-1).values
    return asks & (scaled < ordered.gather(-1, k - 1))


NUCLEUS_CANDIDATES = 1024  # the CPU's first partial sort for top-p (grown eightfold when short)


def _nucleus_threshold(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """The smallest probability top-p keeps: probs [..., V] sorted descending, the token at
    index n - 1, n the number of tokens whose mass strictly before them is below top_p (at least
    one) -> [..., 1]. On the CPU from the largest ``NUCLEUS_CANDIDATES`` probabilities where their
    own mass already reaches top_p in every row (rows with top_p >= 1 are not filtered: theirs is
    unused): the same values, the same prefix sums, so the same threshold as a sort of all V, at
    a fraction of its cost (a 49,152-token sort took about 3.5 ms a row on this project's CPU). A
    host read decides it (there is no device to wait for); CUDA sorts everything, sync-free. With
    the CPU kernels built, ``kernels.cpu.nucleus_threshold`` finds the same value in one call."""
    vocab = probs.shape[-1]
    if cpu_kernels.sampling_usable(probs):  # the same threshold from the C++ kernel
        lead = probs.shape[:-1]
        return cpu_kernels.nucleus_threshold(probs.reshape(-1, vocab), top_p.expand(*lead, 1).reshape(-1)).view(*lead, 1)
    k = vocab if probs.is_cuda else min(vocab, NUCLEUS_CANDIDATES)
    while True:
        top = torch.topk(probs, k, dim=-1).values if k < vocab else torch.sort(probs, dim=-1, descending=True).values
        mass_before = torch.cumsum(top, dim=-1) - top
        # the mass before later tokens only grows: 1e-5 covers the float32 rounding of its steps
        if k == vocab or bool(((mass_before[..., -1:] >= top_p + 1e-5) | (top_p >= 1)).all()):
            # the top token is always kept, also for a top_p below float32's range (stored as 0)
            n_keep = (mass_before < top_p).sum(dim=-1, keepdim=True).clamp(min=1)
            return top.gather(-1, n_keep - 1)
        k = min(vocab, k * 8)


class SamplerBatch:
    """The sampler settings of a batch of rows as tensors, built once per batch change: one
    ``probs`` call processes every row's logits (``process_logits``), one ``sample`` call draws
    every row's token.

    Each row draws its noise from its own stream (all rows' in one launch: ``kernels.noise``), the
    fills ``sample`` draws for that row alone, so a seed fixes a row's output whatever rows run
    beside it. Filters no row asks for are skipped."""

    def __init__(self, params: list[SamplingParams], streams: list[NoiseStream], device: torch.device):
        self.params, self.streams = params, streams
        self.tensors = SamplerTensors(len(params), device)
        self.tensors.write(params)
        self._draft_tensors: SamplerTensors | None = None  # ``draft_probs``'s, built on first use
        self.greedy_rows = [p.greedy for p in params]
        self.all_greedy, self.any_greedy = all(self.greedy_rows), any(self.greedy_rows)
        sampled = [p for p in params if not p.greedy]
        self.filters = dict(top_k=any(p.top_k > 0 for p in sampled), top_p=any(p.top_p < 1 for p in sampled),
                            min_p=any(p.min_p > 0 for p in sampled), greedy=self.any_greedy)

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        """Processed distributions: logits [rows, V] or [rows, positions, V] (penalties already
        applied) -> float32 probs of the same shape. Greedy rows get a one-hot of the argmax."""
        squeeze = logits.dim() == 2
        if squeeze:
            logits = logits[:, None]
        probs = one_hot_argmax(logits.float()) if self.all_greedy else process_logits(logits, self.tensors,
                                                                                       **self.filters)
        return probs[:, 0] if squeeze else probs

    def draft_probs(self, logits: torch.Tensor) -> torch.Tensor:
        """Mirror drafts' distributions: the head's logits [rows, V] (penalties already applied)
        -> float32 q [rows, V], each row under ``draft_params`` of its settings (greedy rows a
        one-hot of the argmax)."""
        if self._draft_tensors is None:
            self._draft_tensors = SamplerTensors(len(self.params), logits.device)
            self._draft_tensors.write([draft_params(p) for p in self.params])
        return process_logits(logits[:, None], self._draft_tensors, top_k=False, top_p=False, min_p=False,
                              greedy=self.any_greedy)[:, 0]

    def sample(self, probs: torch.Tensor, rows: list[int] | None = None) -> torch.Tensor:
        """One token per row from probs [rows, V] -> [rows] long on the device (no host sync):
        greedy rows take the argmax, the others an exponential race with their own stream's
        noise. ``rows``: the batch rows ``probs`` holds (default: all)."""
        rows = list(range(len(self.params))) if rows is None else rows
        if all(self.greedy_rows[r] for r in rows):
            return probs.argmax(dim=-1)
        return self.draw(probs, rows)

    def draw(self, probs: torch.Tensor, rows: list[int]) -> torch.Tensor:
        """Each of ``rows``' token from probs [len(rows), V] -> [len(rows)] long: an exponential
        race with the next fill of its stream (``races``), the argmax for a greedy row. On the
        CPU the C++ kernel draws the same fill and races in one pass (``kernels.cpu.race``)."""
        if not cpu_kernels.sampling_usable(probs):
            return race_winners(probs, self.races(rows, probs.shape[-1], probs.device))
        sampled = [not self.greedy_rows[r] for r in rows]
        keys = torch.tensor([noise.signed_key(self.streams[r].key) if s else 0 for r, s in zip(rows, sampled)])
        fills = torch.tensor([[-1, self.streams[r].take() if s else -1] for r, s in zip(rows, sampled)])
        nothing = torch.zeros(len(rows), 0, dtype=torch.long)
        return cpu_kernels.race(probs[:, None], None, nothing, torch.zeros(len(rows), dtype=torch.long), keys,
                                fills)[:, 1]

    def races(self, rows: list[int], vocab: int, device: torch.device) -> torch.Tensor:
        """These rows' noise for one token's exponential race each, [len(rows), vocab]: the next
        fill of each sampling row's stream, drawn in one launch; ones for a greedy row (which
        draws nothing: its race leaves the argmax)."""
        sampled = [not self.greedy_rows[r] for r in rows]
        keys = [noise.signed_key(self.streams[r].key) if s else 0 for r, s in zip(rows, sampled)]
        fills = [[self.streams[r].take() if s else -1] for r, s in zip(rows, sampled)]
        race = torch.empty(len(rows), 1, vocab, dtype=torch.float32, device=device)
        noise.fill(race, noise.indices(keys, device), noise.indices(fills, device), exponential=True)
        race = race[:, 0]
        if not all(sampled):
            race = torch.where(torch.tensor(sampled).to(device, non_blocking=True)[:, None], race, 1.0)
        return race
