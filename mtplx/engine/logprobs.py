"""Log probabilities of committed tokens, the same whether a token came from an AR step or
from an accepted MTP draft.

The distribution is the target's at the token's position: log-softmax of the verify (or AR)
logits after presence/frequency penalties, the grammar mask and temperature (temperature 0
counts as 1); top-k / top-p / min-p filters are not applied, so the values stay finite for
every unmasked token. A sequence asks for them with ``seq.logprobs = []`` (``seq.top_logprobs``
alternatives per position); for everyone else both calls are no-ops.

``record`` keeps the step's candidate rows on the device ([n, V]: one per position the step
may commit); ``commit`` turns the rows of the tokens actually committed into host numbers
(one sync per step) and drops the rest (a rejected draft's position, a token after EOS).
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
    rows = rows[: len(tokens)]
    index = torch.tensor(tokens, device=rows.device)
    chosen = rows.gather(1, index[:, None])[:, 0]
    k = seq.top_logprobs
    if k:
        top = torch.topk(rows, k, dim=-1)
        values, ids = top.values.tolist(), top.indices.tolist()  # the step's host sync, with the next line
    chosen = chosen.tolist()
    for i, value in enumerate(chosen):
        seq.logprobs.append((value, list(zip(ids[i], values[i])) if k else []))
