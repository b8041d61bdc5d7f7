"""One request's decoding state."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any

import torch

from mtplx.engine.adaptive_depth import DepthPlan
from mtplx.engine.sampling import NoiseStream, SamplingParams
from mtplx.engine.stats import DecodeStats

_ids = itertools.count()


@dataclass
class Sequence:
    """Committed tokens and how far the trunk and the MTP head have cached them.

    tokens[:trunk_len] have trunk KV; tokens[trunk_len] (the last committed token, the
    "primary") is fed at the next forward. head_len: head entries are valid for slots
    < head_len. hidden_backlog: [n, H] trunk hidden states at positions head_len-1 ..
    trunk_len-1, not yet consumed by the head.
    """

    prompt_ids: list[int]
    params: SamplingParams
    max_tokens: int
    noise: NoiseStream = field(default_factory=NoiseStream)  # its random numbers (unseeded by default)
    mode: str = "ar"  # "ar" or "mtp"
    depth: int = 0  # this cycle's draft depth (0: AR)
    depth_plan: DepthPlan | None = None  # depth="auto": its acceptance, for each cycle's depth (adaptive_depth.py)
    draft_policy: str = "greedy"
    ignore_eos: bool = False
    seq_id: int = field(default_factory=lambda: next(_ids))
    tokens: list[int] = field(default_factory=list)
    trunk_len: int = 0
    head_len: int = 0
    cached_prompt_tokens: int = 0
    hidden_backlog: torch.Tensor | None = None
    state_slot: int | None = None  # recurrent state cache slot (hybrid models), from admit to release
    counts: torch.Tensor | None = None  # [V] int, generated-token counts (penalties only)
    constraint: Any = None  # constraints.TokenConstraint: the grammar state of a constrained request
    logprobs: list | None = None  # per generated token (logprob, top alternatives); None: not asked (logprobs.py)
    top_logprobs: int = 0
    pending_logprobs: torch.Tensor | None = None  # this step's candidate rows [n, V]
    prompt_logprobs: list | None = None  # per prompt token after the first, as ``logprobs``; None: not asked
    prompt_top_logprobs: int = 0
    # a prompt fed beside the chain, its first token not yet taken (``Generator.prefill``, wait=False):
    # (an event recorded after its forwards and draw, or None where they ran in order; the token, in pinned memory)
    pending_prefill: tuple[Any, torch.Tensor] | None = None
    finish_reason: str | None = None
    cancelled: bool = False
    stats: DecodeStats = field(default_factory=DecodeStats)
    t_start: float = 0.0
    t_first: float = 0.0

    def __post_init__(self):
        if not self.tokens:
            self.tokens = list(self.prompt_ids)

    @property
    def num_generated(self) -> int:
        return len(self.tokens) - len(self.prompt_ids)

    @property
    def generated(self) -> list[int]:
        return self.tokens[len(self.prompt_ids):]

    def stop_after(self, generated: int) -> None:
        """A stop string ended the output with generated token ``generated``: finish with "stop"
        and drop the tokens a cycle committed past it (with their logprobs), so that the output,
        its usage and its logprobs are what AR steps would have given. Their KV stays with the
        sequence's blocks until it is released."""
        self.finish_reason = "stop"
        del self.tokens[len(self.prompt_ids) + generated:]
        if self.logprobs is not None:
            del self.logprobs[generated:]
        self.stats.generated_tokens = min(self.stats.generated_tokens, generated)

    @property
    def request_depth(self) -> int:
        """The depth the request asked for: its fixed depth, or with depth="auto" the deepest."""
        return self.depth_plan.max_depth if self.depth_plan is not None else self.depth

    @property
    def host_path(self) -> bool:
        """Decodes on the generator's host path: grammar masks and logprobs are per-position host
        work that the device-resident (chained, captured) cycles skip."""
        return self.constraint is not None or self.logprobs is not None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
