"""Training data: the trunk's own generations, decoded in batches through the engine.

A ``Job`` is one prompt with a temperature and a seed; ``decode_rows`` keeps up to ``rows``
sequences in flight (continuous batching: a finished row is released and the next job is
admitted), so the same loop serves data generation (AR, sampled) and acceptance measurement
(MTP, greedy). A ``Corpus`` is the list of finished samples, saved to disk as it grows so an
interrupted build resumes where it stopped.
"""

from __future__ import annotations

import time
from contextlib import closing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Iterator

import torch

from mtplx.engine.llm_engine import Engine, Request
from mtplx.engine.sequence import Sequence


@dataclass(frozen=True)
class Job:
    """One generation: prompt token ids, sampling temperature and seed."""

    key: str
    prompt_ids: tuple[int, ...]
    temperature: float
    seed: int


@dataclass
class Sample:
    """A training sequence: prompt + completion token ids; the loss covers tokens >= prompt_len."""

    tokens: list[int]
    prompt_len: int
    key: str = ""

    @property
    def completion_tokens(self) -> int:
        return len(self.tokens) - self.prompt_len

    @property
    def group(self) -> str:
        """The prompt this sample continues (its tokens), or for plain text its key: samples of
        one group stay on one side of the validation split."""
        if self.key.startswith("text:"):
            return self.key
        return ",".join(map(str, self.tokens[: self.prompt_len]))


@dataclass
class Corpus:
    samples: list[Sample] = field(default_factory=list)
    complete: bool = False
    description: dict = field(default_factory=dict)
    # (samples counted, their completion tokens): samples are only appended, so the count goes on
    # from there (summing them all at every finished row cost ~3% of a GPU corpus's time)
    _counted: tuple[int, int] = field(default=(0, 0), init=False, repr=False, compare=False)

    @property
    def done_keys(self) -> set[str]:
        return {s.key for s in self.samples}

    @property
    def generated_tokens(self) -> int:
        counted, total = self._counted if self._counted[0] <= len(self.samples) else (0, 0)
        total += sum(self.samples[i].completion_tokens for i in range(counted, len(self.samples)))
        self._counted = (len(self.samples), total)
        return total

    def save(self, path: Path) -> None:
        """Atomic write (a temporary file renamed into place); tokens as one flat int32 tensor."""
        tmp = path.with_suffix(".tmp")
        flat = [t for s in self.samples for t in s.tokens]
        torch.save({"tokens": torch.tensor(flat, dtype=torch.int32),
                    "lengths": torch.tensor([len(s.tokens) for s in self.samples], dtype=torch.int32),
                    "prompt_lens": torch.tensor([s.prompt_len for s in self.samples], dtype=torch.int32),
                    "keys": [s.key for s in self.samples], "complete": self.complete,
                    "description": self.description}, tmp)
        tmp.replace(path)

    @classmethod
    def load(cls, path: Path) -> "Corpus":
        raw = torch.load(path, weights_only=True)
        rows = torch.split(raw["tokens"], raw["lengths"].tolist())
        samples = [Sample(r.tolist(), int(n), str(k)) for r, n, k in zip(rows, raw["prompt_lens"], raw["keys"])]
        return cls(samples, bool(raw["complete"]), dict(raw["description"]))


def make_jobs(prompt_ids: list[list[int]], temperatures: Iterable[float], rounds: int, seed: int) -> list[Job]:
    """Round r gives prompt i temperature temperatures[(i + r) % n]: one pass over the prompts
    mixes temperatures, and later rounds revisit each prompt at another temperature."""
    temps = list(temperatures)
    jobs = []
    for r in range(rounds):
        for i, ids in enumerate(prompt_ids):
            temp = temps[(i + r) % len(temps)]
            jobs.append(Job(f"{r}:{i}", tuple(ids), temp, seed * 1_000_003 + r * 100_003 + i))
    return jobs


def generate_corpus(engine: Engine, jobs: list[Job], *, max_new_tokens: int, rows: int, target_tokens: int,
                    corpus: Corpus, save: Callable[[Corpus], None] | None = None, deadline: float | None = None,
                    progress: Callable[[Corpus], None] | None = None, save_every: int = 256) -> Corpus:
    """Decode the jobs not yet in ``corpus`` (AR, each at its temperature) until the corpus holds
    ``target_tokens`` generated tokens, the jobs run out, or ``deadline`` (time.monotonic()) passes.
    ``corpus.complete`` is set unless the deadline stopped it: a resumed build then generates more."""
    done = corpus.done_keys
    pending = [j for j in jobs if j.key not in done]
    out_of_time = False

    def requests():
        nonlocal out_of_time
        for job in pending:
            if corpus.generated_tokens >= target_tokens:
                return
            if deadline and time.monotonic() > deadline:
                out_of_time = True
                return
            req = engine.make_request(list(job.prompt_ids), mode="ar", max_tokens=max_new_tokens,
                                      temperature=job.temperature, seed=job.seed)
            yield job.key, req

    eos = sorted(engine.generator.eos_token_ids)
    since_save = 0
    with closing(decode_rows(engine, requests(), rows)) as finished:  # closing frees the rows' blocks
        for key, seq in finished:
            tokens = list(seq.tokens)
            if seq.finish_reason == "stop" and len(eos) == 1:
                tokens.append(eos[0])  # the trunk ended its turn: the head should learn to predict that too
            corpus.samples.append(Sample(tokens, len(seq.prompt_ids), key))
            since_save += 1
            if progress:
                progress(corpus)
            if save and since_save >= max(save_every, len(corpus.samples) // 8):  # O(n) a save: spaced out
                save(corpus)
                since_save = 0
    corpus.complete = not out_of_time
    if save:
        save(corpus)
    return corpus


def decode_rows(engine: Engine, requests: Iterator[tuple[str, Request]], rows: int,
                deadline: float | None = None) -> Iterator[tuple[str, Sequence]]:
    """Decode requests (all AR or all MTP) with up to ``rows`` in flight; yields (key, finished
    sequence) as rows finish. Blocks are released as each row finishes. Past ``deadline``
    (time.monotonic()) it stops, dropping the rows still decoding."""
    live: list[tuple[str, Sequence]] = []
    source = iter(requests)
    exhausted = False
    try:
        while live or not exhausted:
            if deadline is not None and time.monotonic() > deadline:
                return
            new = []
            while not exhausted and len(live) + len(new) < rows:
                item = next(source, None)
                if item is None:
                    exhausted = True
                    break
                new.append(item)
            live += _start_rows(engine, new)
            running = [s for _, s in live if not s.finished]
            if running:
                with torch.inference_mode():
                    engine.step(running)
            finished = [x for x in live if x[1].finished]
            live = [x for x in live if not x[1].finished]
            for _, seq in finished:
                engine.generator.release(seq)
            yield from finished
    finally:
        for _, seq in live:
            engine.generator.release(seq)


PREFILL_TOKENS = 8192  # padded prompt tokens per batched prefill forward


def _start_rows(engine: Engine, items: list[tuple[str, Request]]) -> list[tuple[str, Sequence]]:
    """Admit new requests and prefill them, several prompts per forward (``prefill_rows``: up to
    PREFILL_TOKENS padded tokens each; their first tokens are sampled there)."""
    started: list[tuple[str, Sequence]] = []
    try:
        with torch.inference_mode():
            for key, req in items:
                seq = engine.new_sequence(req)
                engine.generator.admit(seq)
                started.append((key, seq))
            left = sorted((seq for _, seq in started), key=lambda s: len(s.prompt_ids) - s.trunk_len)
            while left:  # alike lengths together: the group's padded size is its count x its last's length
                n = 1
                while n < len(left) and (n + 1) * (len(left[n].prompt_ids) - left[n].trunk_len) <= PREFILL_TOKENS:
                    n += 1
                engine.generator.prefill_rows(left[:n])
                left = left[n:]
    except BaseException:
        for _, seq in started:
            engine.generator.release(seq)
        raise
    return started
