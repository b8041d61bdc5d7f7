"""Self-generated prompts: the trunk writes user messages itself (the "Magpie" recipe).

An instruction-tuned trunk given its chat template up to the start of a user turn (the system
prompt, if the template adds one, then the user-turn opener) and sampled writes a plausible user
message and ends it with its end-of-turn token. Those messages, filtered, widen the prompt set
beyond the built-in templates: the head then learns the trunk's answers to what users of this
trunk plausibly ask, not only to the templates' few shapes.

Attempt i is sampled with a seed derived from the build's seed and i, and kept prompts are taken
in attempt order (not the order rows finish in), so a run continued after an interruption keeps
the prompts an uninterrupted run keeps.
"""

from __future__ import annotations

import itertools
import json
import time
from contextlib import closing
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Iterable

from mtplx.engine.llm_engine import Engine
from mtplx.engine.sequence import Sequence
from mtplx.forge import ForgeError
from mtplx.forge.data import decode_rows

SENTINEL = "MTPLX-FORGE-USER-MESSAGE-7Q2X"  # stands for the user's message when the template is rendered
MIN_WORDS = 4  # shorter messages are mostly greetings and fragments
MAX_ATTEMPTS_PER_PROMPT = 4  # a trunk that rarely ends its turn gives up after this many samples per prompt


@dataclass
class SelfPrompts:
    """The generated prompts and how they were made (``prompts.json`` in the work folder).

    ``attempts``: samples drawn and decided so far (every attempt below it has finished);
    ``passed``: those that passed the filter (the last in-flight ones may pass beyond ``requested``);
    ``tokens``: tokens those samples generated (end-of-turn tokens included);
    ``done``: the phase ended (enough prompts, attempts used up, or out of time); a stored set
    that is done is reused as it is, one that is not continues at ``attempts``."""

    requested: int
    prefix: str
    temperature: float = 0.9
    max_new_tokens: int = 96
    seed: int = 0
    prompts: list[str] = field(default_factory=list)
    attempts: int = 0
    passed: int = 0
    tokens: int = 0
    done: bool = False
    out_of_time: bool = False
    seconds: float = 0.0

    def save(self, path: Path) -> None:
        """Atomic write (a temporary file renamed into place)."""
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(asdict(self), indent=1, ensure_ascii=False), encoding="utf-8")
        tmp.replace(path)

    @classmethod
    def load(cls, path: Path) -> "SelfPrompts":
        try:
            return cls(**json.loads(Path(path).read_text(encoding="utf-8")))
        except (OSError, TypeError, json.JSONDecodeError) as exc:
            raise ForgeError(f"cannot read the stored self-generated prompts {path}: {exc}; "
                             "delete the file to generate them again") from exc

    def description(self) -> dict:
        """What the provenance records: counts, sampling settings and the prefix."""
        return {"requested": self.requested, "kept": len(self.prompts), "attempts": self.attempts,
                "passed_filter": self.passed, "generated_tokens": self.tokens,
                "pass_rate": round(self.passed / self.attempts, 3) if self.attempts else None,
                "temperature": self.temperature, "max_new_tokens": self.max_new_tokens, "prefix": self.prefix,
                "min_words": MIN_WORDS, "stopped_by_time_budget": self.out_of_time, "seconds": round(self.seconds, 1)}


def user_turn_prefix(tokenizer) -> str:
    """The chat template's text up to where a user message starts: a one-message conversation
    with SENTINEL as the user's message, rendered without a generation prompt, cut at SENTINEL.
    For SmolLM2: '<|im_start|>system\\nYou are a helpful AI assistant named SmolLM, trained by
    Hugging Face<|im_end|>\\n<|im_start|>user\\n'."""
    if tokenizer is None:
        raise ForgeError("self-generated prompts need the trunk's tokenizer and chat template, and this trunk "
                         "has no tokenizer; pass --self-prompts 0")
    if not tokenizer.has_chat_template:
        raise ForgeError(f"{tokenizer.name} has no chat template, so forge cannot find where a user turn starts "
                         "to let the trunk write prompts; pass --self-prompts 0")
    try:
        text = tokenizer.render_chat([{"role": "user", "content": SENTINEL}], add_generation_prompt=False)
    except Exception as exc:  # a template's own error (jinja raise_exception), not a bug here
        raise ForgeError(f"{tokenizer.name}'s chat template fails on one user message: {exc}; "
                         "pass --self-prompts 0") from exc
    cut = text.find(SENTINEL)
    if cut < 0:
        raise ForgeError(f"{tokenizer.name}'s chat template does not show the user's message verbatim, so forge "
                         "cannot find where a user turn starts; pass --self-prompts 0")
    return text[:cut]


def generate_self_prompts(engine: Engine, store: SelfPrompts, *, rows: int, exclude: Iterable[str] = (),
                          deadline: float | None = None, save: Callable[[SelfPrompts], None] | None = None,
                          progress: Callable[[SelfPrompts, int, int], None] | None = None,
                          save_every: int = 256) -> SelfPrompts:
    """Sample user messages from ``store.prefix`` (AR, ``store.temperature``, up to
    ``store.max_new_tokens`` each, ``rows`` in flight) until ``store`` holds ``store.requested``
    prompts, MAX_ATTEMPTS_PER_PROMPT x requested samples were drawn, or ``deadline``
    (time.monotonic()) passes (the samples still decoding then are dropped: a trunk that rarely
    ends its turn would otherwise hold the build for max_new_tokens steps); continues a stored,
    unfinished ``store`` at ``store.attempts``.

    A sample is kept if the trunk ended its turn (finish_reason "stop"), it holds no control
    token, it has at least MIN_WORDS words, and it is new: not an earlier kept prompt and not in
    ``exclude`` (the held-out prompts), compared with case and spacing ignored.
    ``progress(store, distinct, finished)``: after each finished sample, with the distinct usable
    messages so far (what decides when to stop sampling) and the samples finished."""
    t0 = time.monotonic()
    prefix_ids = engine.tokenizer.encode(store.prefix, add_special_tokens=False)
    excluded = {_normal(p) for p in exclude}
    committed = {_normal(p) for p in store.prompts}
    distinct = set(committed)  # normalised usable messages, committed or waiting for earlier attempts
    decided: dict[int, tuple[str | None, int]] = {}  # finished attempt at or above store.attempts -> (message, tokens)
    limit = MAX_ATTEMPTS_PER_PROMPT * store.requested

    def requests():
        for i in itertools.count(store.attempts):
            if len(distinct) >= store.requested or i >= limit or (deadline and time.monotonic() > deadline):
                return
            yield str(i), engine.make_request(prefix_ids, mode="ar", max_tokens=store.max_new_tokens,
                                              temperature=store.temperature, seed=attempt_seed(store.seed, i))

    def commit_in_order(past_gaps: bool = False) -> None:
        """Move finished attempts into ``store`` in attempt order, up to the first unfinished one
        (``past_gaps``: all of them, once the ones before them will never finish)."""
        while store.attempts in decided or (past_gaps and decided):
            i = store.attempts if store.attempts in decided else min(decided)
            message, tokens = decided.pop(i)
            store.attempts = i + 1
            store.tokens += tokens
            if message is None or _normal(message) in committed:
                continue
            store.passed += 1
            committed.add(_normal(message))
            if len(store.prompts) < store.requested:
                store.prompts.append(message)

    since_save = finished_samples = 0
    with closing(decode_rows(engine, requests(), rows, deadline)) as finished:  # closing frees the rows' blocks
        for key, seq in finished:
            message = user_message(engine.tokenizer, seq)
            if message is not None and _normal(message) in excluded:
                message = None
            decided[int(key)] = message, seq.num_generated + (seq.finish_reason == "stop")
            if message is not None:
                distinct.add(_normal(message))
            commit_in_order()
            since_save += 1
            finished_samples += 1
            if progress:
                progress(store, len(distinct), finished_samples)
            if save and since_save >= save_every:
                store.seconds += time.monotonic() - t0
                t0 = time.monotonic()
                save(store)
                since_save = 0
    store.out_of_time = bool(deadline) and time.monotonic() > deadline and len(store.prompts) < store.requested
    commit_in_order(past_gaps=store.out_of_time)
    store.done = True
    store.seconds += time.monotonic() - t0
    if save:
        save(store)
    return store


def user_message(tokenizer, seq: Sequence) -> str | None:
    """The finished sample's text if it is a usable user message, else None."""
    if seq.finish_reason != "stop":
        return None  # ran out of tokens: no end of turn, the message is cut
    ids = seq.generated
    text = tokenizer.decode(ids, skip_special_tokens=True)
    if text != tokenizer.decode(ids, skip_special_tokens=False):
        return None  # a control token inside (e.g. the trunk opened another turn)
    text = text.strip()
    return text if len(text.split()) >= MIN_WORDS else None


def attempt_seed(seed: int, i: int) -> int:
    """The sampling seed of attempt ``i`` (apart from make_jobs' seeds, which start at seed * 1_000_003)."""
    return seed * 1_000_003 + 500_009 + i


def interleave(a: list, b: list) -> list:
    """a and b merged with each spread evenly over the result, both in order: a time-limited pass
    over the result sees both in proportion."""
    keyed = [((i + 0.5) / len(a), 0, x) for i, x in enumerate(a)]
    keyed += [((j + 0.5) / len(b), 1, x) for j, x in enumerate(b)]
    return [x for _, _, x in sorted(keyed, key=lambda k: k[:2])]  # the position in its list, then a before b


def _normal(text: str) -> str:
    return " ".join(text.split()).casefold()
