"""Per-token cost of a grammar's token mask on the default model's tokenizer (49,152 tokens):
xgrammar against llguidance, walking a JSON document that satisfies a schema token by token
(fill the next-token bitmask, then accept the token), as a constrained decode does.

    PYTHONPATH=. python benchmarks/grammar_mask.py [--repeats 20]

Prints, per engine: the one-off tokenizer set-up and schema compile, and the mask fill per
token (mean, median, max over repeats x tokens), on one thread.
"""

import argparse
import importlib.metadata
import json
import statistics
import time

import torch

from mtplx.loading.default_model import default_model_path
from mtplx.loading.tokenizer import Tokenizer

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string"}, "age": {"type": "integer"}, "tags": {"type": "array", "items": {"type": "string"}},
    "address": {"type": "object", "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
                "required": ["city", "zip"]}, "ok": {"type": "boolean"}},
    "required": ["name", "age", "tags", "address", "ok"], "additionalProperties": False}
DOCUMENT = {"name": "Ada Lovelace", "age": 36, "tags": ["math", "poetry", "engines"],
            "address": {"city": "London", "zip": "W1"}, "ok": True}


def summary(times: list[float]) -> str:
    us = [t * 1e6 for t in times]
    return f"mean {statistics.mean(us):.1f} us, median {statistics.median(us):.1f} us, max {max(us):.0f} us"


def xgrammar_case(hf, vocab: int, ids: list[int], repeats: int) -> None:
    import xgrammar as xgr

    t = time.perf_counter()
    compiler = xgr.GrammarCompiler(xgr.TokenizerInfo.from_huggingface(hf, vocab_size=vocab), max_threads=1)
    setup = time.perf_counter() - t
    t = time.perf_counter()
    compiled = compiler.compile_grammar(xgr.Grammar.from_json_schema(json.dumps(SCHEMA), any_whitespace=False))
    compile_s = time.perf_counter() - t
    bitmask = xgr.allocate_token_bitmask(1, vocab)
    times = []
    for _ in range(repeats):
        matcher = xgr.GrammarMatcher(compiled)
        for token in ids:
            t = time.perf_counter()
            matcher.fill_next_token_bitmask(bitmask)
            times.append(time.perf_counter() - t)
            assert matcher.accept_token(token), token
    print(f"xgrammar {importlib.metadata.version('xgrammar')}: tokenizer set-up {setup:.2f} s, "
          f"compile {compile_s * 1e3:.1f} ms; mask per token: {summary(times)}")


def llguidance_case(hf, vocab: int, ids: list[int], repeats: int) -> None:
    import llguidance
    import llguidance.hf
    import llguidance.torch

    t = time.perf_counter()
    tokenizer = llguidance.hf.from_tokenizer(hf, n_vocab=vocab)
    setup = time.perf_counter() - t
    compact = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}  # as xgrammar's
    grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(SCHEMA), defaults=compact)
    bitmask = llguidance.torch.allocate_token_bitmask(1, vocab)
    times, compile_s = [], []
    for _ in range(repeats):
        t = time.perf_counter()
        matcher = llguidance.LLMatcher(tokenizer, grammar)
        compile_s.append(time.perf_counter() - t)
        assert not matcher.get_error(), matcher.get_error()
        for token in ids:
            t = time.perf_counter()
            llguidance.torch.fill_next_token_bitmask(matcher, bitmask, 0)
            times.append(time.perf_counter() - t)
            assert matcher.consume_token(token), matcher.get_error()
    print(f"llguidance {importlib.metadata.version('llguidance')}: tokenizer set-up "
          f"{setup:.2f} s, matcher {statistics.median(compile_s) * 1e3:.1f} ms; mask per token: {summary(times)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    torch.set_num_threads(1)
    tokenizer = Tokenizer.from_gguf(default_model_path(progress=False))
    vocab = tokenizer.vocab_size
    text = json.dumps(DOCUMENT, separators=(", ", ": "))
    ids = tokenizer.encode(text, add_special_tokens=False)
    print(f"vocabulary {vocab}, document {len(ids)} tokens, {args.repeats} repeats")
    xgrammar_case(tokenizer.hf, vocab, ids, args.repeats)
    llguidance_case(tokenizer.hf, vocab, ids, args.repeats)


if __name__ == "__main__":
    main()
