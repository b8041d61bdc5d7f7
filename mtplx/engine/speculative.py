"""Exact acceptance of drafted tokens: the one rejection sampler every scheduler mode calls.

One verify step checks k drafted tokens against the target model and emits
``accepted`` drafts plus one more token (a correction on the first miss, or the bonus token
when all k are accepted), so 1..k+1 tokens per step.

Inputs, for one sequence:
- ``target_probs`` / ``target_logits``: [k+1, V]. Row i is the target's next-token
  distribution at the position of draft i, i.e. conditioned on prefix + drafts[:i]; row k is
  the bonus position, conditioned on prefix + all k drafts. Target and draft distributions
  must come out of the same processing (``sampling.logits_to_probs`` with the same params);
  with presence/frequency penalties the caller computes each row's penalties from token counts
  that include the drafts before it.
- ``draft_probs``: [k, V], row i the draft distribution q_i the draft token i was drawn from;
  ``None`` when drafts were chosen deterministically (greedy drafts: q_i is one-hot).
- ``draft_tokens``: [k] long.

Sampled targets (Leviathan et al. 2023, Chen et al. 2023): accept draft x_i with probability
min(1, p_i(x_i) / q_i(x_i)); at the first rejection sample from the residual
max(0, p_i - q_i) renormalised; if all k are accepted sample the bonus token from p_k. Every
emitted token is then distributed exactly as the target would have sampled it one at a time.
Greedy targets use ``verify_greedy``: accept while draft == argmax, the correction is the argmax.

Both functions keep the work on the device and sync with the host once, at the end, to hand
the engine two integers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from mtplx.engine.sampling import NoiseStream, exponential_, uniform_
from mtplx.kernels import cpu as cpu_kernels, cycle as cycle_kernels, noise, sampling as sampling_kernels


class VerifyOutcome(NamedTuple):
    """How many drafts were accepted (0..k) and the token emitted after them."""

    accepted: int
    next_token: int


@dataclass
class CycleOutcome:
    """What one cycle decided for each of its rows, on the host: the drafts (each cut to its
    row's own depth; empty for an AR step, a cycle of depth 0), how many of them were
    accepted, and the token emitted after them (the correction, or the bonus token). A row
    whose own work failed has ``next_tokens[r] is None`` and is not committed."""

    drafts: list[list[int]]
    accepted: list[int]
    next_tokens: list[int | None]

    @classmethod
    def unpack(cls, rows: list[list[int]], depths: list[int]) -> CycleOutcome:
        """From packed device rows ``[drafts (k), accepted, next]`` (``greedy_outcome``'s
        layout, k the cycle's depth), each row's drafts cut to ``depths[r]``."""
        k = len(rows[0]) - 2 if rows else 0
        return cls([row[:d] for row, d in zip(rows, depths)], [row[k] for row in rows], [row[k + 1] for row in rows])

    def row(self, r: int) -> tuple[list[int], int, int | None]:
        return self.drafts[r], self.accepted[r], self.next_tokens[r]


def greedy_outcome(target_tokens: torch.Tensor, drafts: torch.Tensor, depths: torch.Tensor | None = None
                   ) -> torch.Tensor:
    """Greedy acceptance for rows at once, on the device (no host sync; CUDA graphs capture it).

    target_tokens: [rows, k+1] long, the target's argmax at each draft position and the bonus
    position; drafts: [rows, k] long; depths: [rows, 1] long, each row's own depth (its
    acceptance is capped there: a batch drafts to its deepest row), or None (all k). Accepts
    drafts left to right while each equals the target's argmax; the next token is the argmax
    at the first miss, or the bonus when all are accepted. Returns the packed outcome
    [rows, k + 2]: drafts, accepted count, next token (``CycleOutcome.unpack`` reads it)."""
    if cycle_kernels.usable(target_tokens) and drafts.dtype == torch.long:  # one launch on CUDA
        return cycle_kernels.greedy_outcome(target_tokens, drafts, depths)
    k = drafts.shape[1]
    accepted = (target_tokens[:, :k] == drafts).long().cumprod(dim=1).sum(dim=1, keepdim=True)
    if depths is not None:
        accepted = torch.minimum(accepted, depths)
    return torch.cat([drafts, accepted, target_tokens.gather(1, accepted)], dim=1)


def verify_greedy(target_logits: torch.Tensor, draft_tokens: torch.Tensor) -> VerifyOutcome:
    """Greedy verification of one row. target_logits: [k+1, V] (logits or probs);
    draft_tokens: [k] long. ``greedy_outcome`` for one row (argmax ties toward the lowest
    index, as torch.argmax): the emitted tokens equal greedy autoregressive decoding's."""
    _check_shapes(target_logits, None, draft_tokens)
    k = draft_tokens.shape[0]
    packed = greedy_outcome(target_logits.argmax(dim=-1)[None], draft_tokens.long()[None])[0]
    return _to_host(packed[k], packed[k + 1])


def verify_sampled(
    target_probs: torch.Tensor,
    draft_probs: torch.Tensor | None,
    draft_tokens: torch.Tensor,
    stream: NoiseStream,
) -> VerifyOutcome:
    """Exact rejection sampling of k drafts; see the module docstring for the shapes.

    Draws k uniforms and one exponential race over V from ``stream`` (on the probs' device),
    always the same fills, so a seeded run is reproducible.
    """
    return _to_host(*sampled_outcome(target_probs, draft_probs, draft_tokens, stream))


def sampled_outcome(
    target_probs: torch.Tensor,
    draft_probs: torch.Tensor | None,
    draft_tokens: torch.Tensor,
    stream: NoiseStream,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``verify_sampled`` left on the device: (accepted, next token) as 0-dim long tensors, for
    a caller that brings several rows' outcomes to the host in one transfer. Draws k uniforms,
    then one exponential race over V, from ``stream`` (``draw_noise``), and decides with
    ``rejection_outcome``, as a CUDA cycle graph does for many rows (on the CPU the C++ kernel
    draws the same fills and decides in one call: ``kernels.cpu.race``)."""
    _check_shapes(target_probs, draft_probs, draft_tokens)
    k, vocab = draft_tokens.shape[0], target_probs.shape[1]
    if cpu_kernels.sampling_usable(target_probs, draft_probs):
        fills = [stream.take() if k else -1, stream.take()]  # draw_noise's order
        packed = cpu_kernels.race(target_probs[None], None if draft_probs is None else draft_probs[None],
                                  draft_tokens.long()[None], torch.tensor([k]),
                                  torch.tensor([noise.signed_key(stream.key)]), torch.tensor([fills]))
        return packed[0, k], packed[0, k + 1]
    uniforms, race = draw_noise(k, vocab, stream, target_probs.device)
    uniforms, race = uniforms.to(target_probs.dtype), race.to(target_probs.dtype)
    packed = rejection_outcome(target_probs[None], None if draft_probs is None else draft_probs[None],
                               draft_tokens.long()[None], None, uniforms[None], race[None])
    return packed[0, k], packed[0, k + 1]


def draw_noise(k: int, vocab: int, stream: NoiseStream, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """One row's noise for one exact rejection-sampling decision, in the order every path draws
    it (``runner.CycleSampling`` plans the same fills for a chained cycle): k uniforms (one per
    draft; no fill when k is 0), then an exponential race over the vocabulary (the emitted
    token's sample). float32 tensors [k], [vocab]."""
    uniforms = torch.empty(k, device=device, dtype=torch.float32)
    if k:
        uniform_(uniforms, stream)
    return uniforms, exponential_(torch.empty(vocab, device=device, dtype=torch.float32), stream)


def rejection_outcome(target_probs: torch.Tensor, draft_probs: torch.Tensor | None, drafts: torch.Tensor,
                      depths: torch.Tensor | None, uniforms: torch.Tensor, race: torch.Tensor) -> torch.Tensor:
    """Exact rejection sampling for rows at once, from noise drawn beforehand (no host sync, no
    generator: a CUDA graph captures it). target_probs: [rows, k+1, V]; draft_probs: [rows, k, V]
    or None (one-hot drafts); drafts: [rows, k] long; depths: [rows, 1] long, each row's own
    number of drafts (None: all k); uniforms: [rows, >= k]; race: [rows, V] exponentials.

    Draft i is accepted when u_i < min(1, p_i(x_i) / q_i(x_i)) (probability exactly that),
    left to right; at the first rejection the emitted token is drawn from the residual
    max(0, p_i - q_i) renormalised (for a one-hot draft, p_i with x_i removed), after all of a
    row's drafts from the bonus distribution p_k; the draw is argmax(dist / race), an
    exponential race. Returns the packed outcome [rows, k + 2]: drafts, accepted, next token
    (``greedy_outcome``'s layout). Rows whose p is a one-hot (greedy rows) get the greedy
    outcome. On CUDA one Triton kernel does it (``kernels.sampling.rejection``)."""
    rows, k1, vocab = target_probs.shape
    k = k1 - 1
    depths = torch.full((rows, 1), k, dtype=torch.long, device=drafts.device) if depths is None else depths
    if sampling_kernels.usable(target_probs) and target_probs.dtype == uniforms.dtype == race.dtype == torch.float32:
        return sampling_kernels.rejection(target_probs, draft_probs, drafts, depths, uniforms, race)
    index = drafts[:, :, None]
    p_x = target_probs[:, :k].gather(2, index).squeeze(2)
    if draft_probs is None:
        accept = p_x.clamp(max=1.0)
    else:
        q_x = draft_probs.gather(2, index).squeeze(2)
        accept = (p_x / q_x.clamp(min=torch.finfo(q_x.dtype).tiny)).clamp(max=1.0)
    accepted = (uniforms[:, :k] < accept).long().cumprod(dim=1).sum(dim=1, keepdim=True)
    accepted = torch.minimum(accepted, depths)
    p = target_probs.gather(1, accepted[:, :, None].expand(rows, 1, vocab)).squeeze(1)
    if k:
        at = accepted.clamp(max=k - 1)  # the bonus row has no draft: its residual is computed, then discarded
        if draft_probs is None:
            residual = p.scatter(1, drafts.gather(1, at), 0.0)
        else:
            residual = (p - draft_probs.gather(1, at[:, :, None].expand(rows, 1, vocab)).squeeze(1)).clamp(min=0.0)
        mass = residual.sum(dim=1, keepdim=True)
        # a rejection implies residual mass in exact arithmetic; should rounding leave none, p itself
        residual = torch.where(mass > 0, residual / mass.clamp(min=torch.finfo(mass.dtype).tiny), p)
        p = torch.where(accepted == depths, p, residual)
    return torch.cat([drafts, accepted, torch.argmax(p / race, dim=1, keepdim=True)], dim=1)


def acceptance_probs(
    target_probs: torch.Tensor, draft_probs: torch.Tensor | None, draft_tokens: torch.Tensor
) -> torch.Tensor:
    """min(1, p_i(x_i) / q_i(x_i)) for each draft i -> [k]; q_i(x_i) = 1 for one-hot drafts.

    target_probs: [k+1, V] (only the first k rows are read). A draft with q_i(x_i) = 0 cannot
    have been drawn from q_i; should one arrive anyway it is accepted iff p_i(x_i) > 0, which
    keeps the ratio finite instead of dividing by zero.
    """
    k = draft_tokens.shape[0]
    index = draft_tokens.long().view(k, 1)
    p_x = target_probs[:k].gather(1, index).squeeze(1)
    if draft_probs is None:
        return p_x.clamp(max=1.0)
    q_x = draft_probs.gather(1, index).squeeze(1)
    tiny = torch.finfo(q_x.dtype).tiny
    return (p_x / q_x.clamp(min=tiny)).clamp(max=1.0)


def next_token_distribution(
    target_probs: torch.Tensor,
    draft_probs: torch.Tensor | None,
    draft_tokens: torch.Tensor,
    accepted: int | torch.Tensor,
) -> torch.Tensor:
    """The distribution the emitted token is drawn from after ``accepted`` drafts -> [V].

    accepted == k: the bonus distribution p_k. accepted = i < k (draft i rejected): the
    residual max(0, p_i - q_i) renormalised, which for a one-hot draft is p_i with x_i removed.
    A rejection implies positive residual mass in exact arithmetic; if rounding leaves none,
    p_i itself is returned rather than an empty distribution.
    """
    k = draft_tokens.shape[0]
    row = torch.as_tensor(accepted, device=target_probs.device).long().view(1)
    p = target_probs.index_select(0, row).squeeze(0)
    if k == 0:
        return p
    draft_row = row.clamp(max=k - 1)  # row k has no draft; its residual is computed, then discarded
    if draft_probs is None:
        residual = p.scatter(0, draft_tokens.long().index_select(0, draft_row), 0.0)
    else:
        residual = (p - draft_probs.index_select(0, draft_row).squeeze(0)).clamp(min=0.0)
    mass = residual.sum()
    residual = torch.where(mass > 0, residual / mass.clamp(min=torch.finfo(mass.dtype).tiny), p)
    return torch.where(row == k, p, residual)


def _count_leading_true(matches: torch.Tensor) -> torch.Tensor:
    """[k] bool -> 0-dim long: the length of the all-True prefix (first rejection index)."""
    return matches.long().cumprod(dim=0).sum()


def _to_host(accepted: torch.Tensor, next_token: torch.Tensor) -> VerifyOutcome:
    # The step's one deliberate host sync: the engine needs both as integers to commit tokens.
    accepted_host, token_host = torch.stack([accepted.view(()), next_token.view(())]).tolist()
    return VerifyOutcome(accepted_host, token_host)


def _check_shapes(target: torch.Tensor, draft_probs: torch.Tensor | None, draft_tokens: torch.Tensor) -> None:
    k = draft_tokens.shape[0]
    if draft_tokens.dim() != 1 or target.dim() != 2 or target.shape[0] != k + 1:
        raise ValueError(f"expected draft_tokens [k] and target [k+1, V], got {tuple(draft_tokens.shape)} "
                         f"and {tuple(target.shape)}")
    if draft_probs is not None and draft_probs.shape != (k, target.shape[1]):
        raise ValueError(f"expected draft_probs [k, V] = [{k}, {target.shape[1]}], got {tuple(draft_probs.shape)}")
