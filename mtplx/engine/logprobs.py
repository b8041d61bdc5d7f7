"""Log probabilities of committed tokens, the same whether a token came from an AR step or
from an accepted MTP draft, and of prompt tokens (prompt scoring).

The distribution is the target's at the token's position: log-softmax of the verify (or AR)
logits after presence/frequency penalties, the grammar mask and temperature (temperature 0
counts as 1); top-k / top-p / min-p filters are not applied, so the values stay finite for
every unmasked token. A sequence asks for them with ``seq.logprobs = []`` (``seq.top_logprobs``
alternatives per position); for everyone else both calls are no-ops.

``record`` keeps the step's candidate rows on the device ([n, V]: one per position the step
may commit); ``commit`` turns the rows of the tokens actually committed into host numbers
(one sync per step) and drops the rest (a rejected draft's position, a token after EOS).

Prompt scoring (``seq.prompt_logprobs = []``): ``record_prompt`` scores each prompt token but
the first from the prefill forward's logits at the position before it, by the same rule.
Every prompt position must then be computed, so such a sequence takes no prefix-cache hit
(``cache_namespace``).
"""

from __future__ import annotations

from typing import Any

import torch


def record(seq: Any, logits: torch.Tensor) -> None:
    """logits: [n, V] processed target logits of the next n positions this step may commit."""
    if seq.logprobs is None:
        return
    temperature = seq.params.temperature or 1.0
    seq.pending_logprobs = torch.log_softmax(logits.float() / temperature, dim=-1)


def cache_namespace(seq: Any, namespace: str | None) -> str | None:
    """The prefix-cache namespace for ``seq``: its own (never hit) when its prompt is scored."""
    return namespace if getattr(seq, "prompt_logprobs", None) is None else f"scored-prompt-{seq.seq_id}"


def record_prompt(seq: Any, logits_of, hidden: torch.Tensor, start: int) -> None:
    """Score the prompt tokens after positions start .. start + len(hidden) - 1.
    hidden: [n, H] the prefill chunk's trunk output; logits_of: hidden -> logits."""
    if getattr(seq, "prompt_logprobs", None) is None:
        return
    n = min(len(hidden), len(seq.prompt_ids) - 1 - start)  # the last position predicts the first output
    if n <= 0:
        return
    rows = torch.log_softmax(logits_of(hidden[:n]).float() / (seq.params.temperature or 1.0), dim=-1)
    seq.prompt_logprobs += _entries(rows, seq.prompt_ids[start + 1: start + 1 + n], seq.prompt_top_logprobs)


def commit(seq: Any, tokens: list[int]) -> None:
    """Append (logprob, [(token, logprob), ...top]) for each committed token, in order."""
    if seq.logprobs is None:
        return
    rows, seq.pending_logprobs = seq.pending_logprobs, None
    if not tokens:
        return
    if rows is None or rows.shape[0] < len(tokens):
        raise RuntimeError(f"{len(tokens)} tokens committed but {0 if rows is None else rows.shape[0]} "
                           "logprob rows recorded")
    seq.logprobs += _entries(rows[: len(tokens)], tokens, seq.top_logprobs)


def _entries(rows: torch.Tensor, tokens: list[int], k: int) -> list[tuple[float, list]]:
    """(logprob of tokens[i] in rows[i], its k best (token, logprob)) for each row; one host sync."""
    index = torch.tensor(tokens, device=rows.device)
    chosen = rows.gather(1, index[:, None])[:, 0]
    if k:
        top = torch.topk(rows, k, dim=-1)
        values, ids = top.values.tolist(), top.indices.tolist()
    return [(value, list(zip(ids[i], values[i])) if k else []) for i, value in enumerate(chosen.tolist())]
