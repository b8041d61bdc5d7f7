"""Per-request speculative-decoding statistics (vLLM-compatible meanings)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class DecodeStats:
    depth: int = 0  # the request's depth; with adaptive, the deepest a cycle may draft
    adaptive: bool = False  # depth="auto": cycles_by_depth says which depths the row chose
    cycles_by_depth: list[int] = field(default_factory=list)  # cycles that drafted 1, 2, ... tokens
    ar_steps: int = 0  # adaptive: steps that drafted nothing (one token, no verify of drafts)
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    verify_calls: int = 0
    drafted_by_depth: list[int] = field(default_factory=list)
    accepted_by_depth: list[int] = field(default_factory=list)
    correction_tokens: int = 0
    bonus_tokens: int = 0
    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0
    generated_tokens: int = 0
    ttft_s: float = 0.0
    decode_s: float = 0.0
    draft_s: float = 0.0
    verify_s: float = 0.0
    accept_s: float = 0.0
    commit_s: float = 0.0

    def record_cycle(self, drafted: int, accepted: int, full: bool) -> None:
        """One verify call that checked ``drafted`` drafts and accepted the first ``accepted``."""
        if len(self.drafted_by_depth) < drafted:
            grow = drafted - len(self.drafted_by_depth)
            self.drafted_by_depth += [0] * grow
            self.accepted_by_depth += [0] * grow
        if drafted:
            self.cycles_by_depth += [0] * (drafted - len(self.cycles_by_depth))
            self.cycles_by_depth[drafted - 1] += 1
        for i in range(drafted):
            self.drafted_by_depth[i] += 1
            self.accepted_by_depth[i] += int(i < accepted)
        self.drafted_tokens += drafted
        self.accepted_tokens += accepted
        self.verify_calls += 1
        if full:
            self.bonus_tokens += 1
        else:
            self.correction_tokens += 1

    def as_dict(self) -> dict:
        out = dict(self.__dict__)
        calls = self.verify_calls
        out["mean_acceptance_length"] = 1.0 + self.accepted_tokens / calls if calls else None
        out["acceptance_rate"] = self.accepted_tokens / self.drafted_tokens if self.drafted_tokens else None
        out["acceptance_rate_by_position"] = [
            a / d if d else 0.0 for a, d in zip(self.accepted_by_depth, self.drafted_by_depth)
        ]
        # tokens after the first, over the time spent producing them
        out["decode_tok_s"] = (self.generated_tokens - 1) / self.decode_s if self.decode_s > 0 else None
        return out
