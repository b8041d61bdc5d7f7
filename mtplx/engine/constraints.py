"""Grammar-constrained decoding that keeps MTP: a token mask per position from a grammar
matcher (xgrammar), applied to the target distribution at every verified position.

A constrained sequence carries a ``TokenConstraint`` (``seq.constraint``; None for every other
request, and then each function here returns its input untouched). Its matcher holds the
grammar state after the committed tokens. Per MTP cycle (as vLLM fills one bitmask row per
draft position, REFERENCE.md section 9):

- ``mask_draft``: the head drafts under the mask of the position it drafts for (the matcher
  walks the drafts so far, then rolls back), so a sampled draft's q is the masked
  distribution: exactness needs the draft and target processed alike;
- ``cut_drafts``: drafts the grammar rejects (and every one after) are cut before the verify
  forward (a safety net: masked drafting proposes none);
- ``mask_verify``: row i of the verify logits gets the mask after drafts[:i] (the bonus row
  after all of them); the matcher rolls back to the committed state;
- ``advance``: the committed tokens (accepted drafts + the next token) move the matcher.

Masked logits are -inf outside the allowed set, before temperature / top-k / top-p, so the
processed distribution is the target's restricted to the grammar and renormalised, which is
what constrained AR decoding samples; rejection sampling against it keeps MTP exact. Once the
grammar is complete only end-of-sequence tokens are allowed.

Masks are built on the host (xgrammar's bitmask, about 10 us per position on this CPU for a
49k vocabulary: docs/server.md), so constrained rows take the generator's host path (no
chained or captured cycle).
"""

from __future__ import annotations

import json
import re
from typing import Any, Sequence as Seq

import torch

from mtplx.errors import InvalidParameter



class GrammarCompiler:
    """Compiles grammars for one tokenizer and vocabulary (built once per engine: ~0.2 s for
    a 49k vocabulary). ``stop_ids``: the tokens that end a sequence (what a complete grammar
    allows)."""

    def __init__(self, hf_tokenizer, vocab_size: int, stop_ids: Seq[int], *, vocab: list[str] | None = None):
        """From a transformers tokenizer, or (``vocab``) from each token's literal text."""
        import xgrammar as xgr

        self.xgr = xgr
        self.vocab_size = vocab_size
        if vocab is not None:
            info = xgr.TokenizerInfo(vocab, xgr.VocabType.RAW, vocab_size=vocab_size, stop_token_ids=list(stop_ids))
        else:
            info = xgr.TokenizerInfo.from_huggingface(hf_tokenizer, vocab_size=vocab_size,
                                                      stop_token_ids=list(stop_ids))
        self.compiler = xgr.GrammarCompiler(info, max_threads=1)

    def ebnf(self, source: str, param: str = "grammar") -> Grammar:
        """Text of the EBNF grammar ``source`` (xgrammar / GBNF syntax, start rule ``root``)."""
        return Grammar(self._compile(lambda: self.xgr.Grammar.from_ebnf(source), param), self.vocab_size)

    def json_schema(self, schema: dict, param: str = "schema") -> Grammar:
        """JSON text valid against ``schema`` (compact: ", " and ": " separators, no free whitespace,
        which small models would otherwise fill)."""
        source = json.dumps(schema)  # xgrammar caches compiled schemas by their text (key order is output order)
        return Grammar(self._compile(lambda: source, param, lambda text: self.compiler.compile_json_schema(
            text, any_whitespace=False, strict_mode=True)), self.vocab_size)

    def tagged_json(self, options: list[tuple[str, dict, str]], param: str) -> Grammar:
        """One of ``options`` (prefix, JSON schema, suffix): the text prefix, JSON valid against
        the schema, the suffix. For tool calls: ``<tool_call>\\n`` + {"name", "arguments"} + ..."""
        xgr = self.xgr

        def build():
            grammars = [xgr.Grammar.concat(xgr.Grammar.from_ebnf(f"root ::= {json.dumps(prefix)}"),
                                           xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False),
                                           xgr.Grammar.from_ebnf(f"root ::= {json.dumps(suffix)}"))
                        for prefix, schema, suffix in options]
            return grammars[0] if len(grammars) == 1 else xgr.Grammar.union(*grammars)
        return Grammar(self._compile(build, param), self.vocab_size)

    def _compile(self, build, param: str, compile=None):
        try:
            return (compile or self.compiler.compile_grammar)(build())
        except (RuntimeError, ValueError, TypeError) as exc:  # a schema xgrammar cannot turn into a grammar
            reason = _LOG_PREFIX.sub("", str(exc).splitlines()[0])  # not the engine's log line's time and source file
            raise InvalidParameter(param, f"cannot build a grammar from it: {reason}") from None


# "[10:24:48] /project/cpp/regex_converter.cc:94: " before a grammar engine's message
_LOG_PREFIX = re.compile(r"^\s*\[[\d:]+\]\s*\S+:\d+:\s*")


class Grammar:
    """A compiled grammar (shared by the requests that use it); ``matcher()`` starts one
    sequence's ``TokenConstraint``."""

    def __init__(self, compiled, vocab_size: int):
        self.compiled, self.vocab_size = compiled, vocab_size

    def matcher(self) -> TokenConstraint:
        return TokenConstraint(self.compiled, self.vocab_size)


class TokenConstraint:
    """One sequence's grammar state: allowed-token masks, accept, rollback."""

    def __init__(self, compiled, vocab_size: int):
        import xgrammar as xgr

        self.matcher = xgr.GrammarMatcher(compiled)  # rollback is unlimited in xgrammar >= 0.2
        self.vocab_size = vocab_size
        self.bitmask = xgr.allocate_token_bitmask(1, vocab_size)
        self._shifts = torch.arange(32, dtype=torch.int32)
        self.masks_built = 0  # positions masked (telemetry)

    def allowed(self) -> torch.Tensor:
        """[V] bool: the tokens the grammar allows after the accepted ones. After an accepted
        end-of-sequence token (a draft: nothing after it is committed; or ignore_eos) the
        grammar has ended and every token is allowed."""
        if self.matcher.is_terminated():
            return torch.ones(self.vocab_size, dtype=torch.bool)
        self.matcher.fill_next_token_bitmask(self.bitmask)
        self.masks_built += 1
        bits = (self.bitmask[0, :, None] >> self._shifts) & 1  # [V/32, 32], bit j of word w = token 32w + j
        return bits.flatten()[: self.vocab_size].bool()

    def accept(self, token: int) -> bool:
        return bool(self.matcher.accept_token(int(token)))

    def rollback(self, n: int) -> None:
        if n:
            self.matcher.rollback(n)

    def walk(self, tokens: Seq[int]) -> int:
        """Accept ``tokens`` while the grammar allows them; how many were accepted (roll them back)."""
        n = 0
        for token in tokens:
            if not self.accept(token):
                break
            n += 1
        return n


def masked(logits: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """logits [n, V] with -inf where ``allowed`` [n, V] (or [V]) is False."""
    return logits.masked_fill(~allowed.to(logits.device), float("-inf"))


# -- the generator's call sites (each a no-op for unconstrained sequences) -----------------------
def mask_next(seq: Any, logits: torch.Tensor) -> torch.Tensor:
    """logits [1, V] for the next committed position, masked."""
    c = seq.constraint
    return logits if c is None else masked(logits, c.allowed())


def mask_draft(seq: Any, logits: torch.Tensor, previous: list[int]) -> torch.Tensor:
    """Head logits [1, V] for the draft after ``previous`` drafts, masked by the grammar state
    after them (unmasked if the grammar rejects one of them: that draft is cut anyway)."""
    c = seq.constraint
    if c is None:
        return logits
    n = c.walk(previous)
    try:
        return masked(logits, c.allowed()) if n == len(previous) else logits
    finally:
        c.rollback(n)


def cut_drafts(seqs: list, drafts: list[list[int]], draft_probs: list[list]) -> tuple[list, list]:
    """Each constrained row's drafts up to the first one its grammar rejects."""
    if all(s.constraint is None for s in seqs):
        return drafts, draft_probs
    for r, seq in enumerate(seqs):
        if seq.constraint is not None:
            n = seq.constraint.walk(drafts[r])
            seq.constraint.rollback(n)
            drafts[r], draft_probs[r] = drafts[r][:n], draft_probs[r][:n]
    return drafts, draft_probs


def mask_verify(seq: Any, logits: torch.Tensor, drafts: list[int]) -> torch.Tensor:
    """Verify logits [k+1, V]: row i masked by the grammar after drafts[:i] (every draft is
    one the grammar accepts: ``cut_drafts`` ran); the matcher ends at the committed state."""
    c = seq.constraint
    if c is None:
        return logits
    rows = []
    for i in range(len(drafts) + 1):
        rows.append(c.allowed())
        if i < len(drafts) and not c.accept(drafts[i]):
            raise RuntimeError(f"draft {drafts[i]} at position {i} is not allowed by the grammar "
                               "(cut_drafts should have cut it)")
    c.rollback(len(drafts))
    return masked(logits, torch.stack(rows))


def advance(seq: Any, tokens: list[int]) -> None:
    """Move the grammar past committed ``tokens`` (a token it refuses is a bug: masks allow
    only grammatical tokens)."""
    c = seq.constraint
    if c is None:
        return
    for token in tokens:
        if not c.accept(token):
            raise RuntimeError(f"committed token {token} is not allowed by the request's grammar")
