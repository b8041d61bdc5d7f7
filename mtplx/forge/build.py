"""``mtplx forge build``: trunk -> corpus of its own generations -> trained head -> measured artifact.

Phases (each resumable from ``work_dir``):
  0. self prompts: user messages the trunk writes itself from its chat template's user-turn
     opener (self_prompts.py), filtered and deduplicated (``prompts.json``), interleaved with the
     prompt set;
  1. corpus: the trunk's own completions of the prompt set (AR, mixed temperatures), batched
     through the engine; saved every few hundred sequences (``corpus.pt``);
  2. training: self-distillation against the frozen trunk (train.py), checkpointed (``train.pt``);
  3. measurement: the head, rounded to the shipped dtype and loaded the way ``mtplx.load`` loads
     it, decodes the held-out prompts at the measured depth, greedily and sampled (mirror
     drafts) at each measured temperature; acceptance per depth is recorded in the provenance
     beside the weights.

``--corpus FILE`` takes phase 1's output from an earlier build (``--corpus-only`` stops after
it) instead of generating one, so one stored corpus serves many trainings (benchmarks/
forge_matrix.py trains several head variants on one); repeated, it trains on several as one.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Sequence

import torch
from safetensors.torch import save_file
from tqdm import tqdm

from mtplx import __version__
from mtplx.cache.kv_cache import PagedKVCache
from mtplx.engine.llm_engine import Engine
from mtplx.errors import UnsupportedModel
from mtplx.forge import ForgeError
from mtplx.forge import prompts as prompt_set
from mtplx.forge.artifact import head_state, write_head
from mtplx.forge.data import Corpus, Sample, generate_corpus, make_jobs
from mtplx.forge.measure import acceptance_by_temperature, acceptance_line
from mtplx.forge.self_prompts import SelfPrompts, generate_self_prompts, interleave, user_turn_prefix
from mtplx.forge.train import Trainer, TrainSettings, init_head, make_batches, prepare_batch, split_samples
from mtplx.loading.checkpoint import LoadedModel
from mtplx.loading.mtp_weights import ZERO_CENTERED_FAMILIES, HeadWeights, load_sidecar
from mtplx.loading.weights import attach_head
from mtplx.models.config import MTPConfig, feature_layers
from mtplx.runtime import resolve_kv_dtype

# Trunks whose every layer is full attention over the paged KV cache (the training forward's shape).
FORGE_MODEL_TYPES = ("llama", "qwen2", "qwen3")
# Shares of --max-seconds by which self-prompt generation (default; ``self_prompt_share``),
# completion generation and training stop.
PROMPT_PHASE, GEN_PHASE, TRAIN_PHASE = 0.15, 0.45, 0.90
_BAR_INTERVAL = 0.1 if sys.stderr.isatty() else 15.0  # seconds; a log file gets a line now and then


@dataclass
class BuildSettings:
    tokens: int = 1_000_000  # generated tokens to aim for
    max_new_tokens: int = 256
    temperatures: tuple[float, ...] = (0.0, 0.7)
    rounds: int = 3  # passes over the prompt set, at most
    gen_rows: int | None = None  # sequences decoded together (None: ``generation_rows`` chooses)
    seed: int = 0
    self_prompts: int = 0  # user messages the trunk writes itself, added to the prompt set (0: none)
    self_prompt_temperature: float = 0.9  # 1.0 writes more garbled messages, hardly more varied ones
    self_prompt_max_new_tokens: int = 96
    self_prompt_share: float = PROMPT_PHASE  # of max_seconds, by which self-prompt generation stops
    max_seconds: float | None = None  # wall-clock budget for the whole build
    features: str = "final"  # what the head reads of the trunk (models/config.py HEAD_FEATURES)
    head_layers: int = 1
    draft_vocab: int = 0  # keep the N most frequent corpus tokens as the draft vocabulary (0: all)
    second_mlp: int = 0  # MLP width of the head's layers after the first (0: the trunk's)
    measure_depth: int = 3
    measure_max_tokens: int = 128
    measure_rows: int = 32
    measure_temperatures: tuple[float, ...] = (0.0, 0.7, 1.0)  # held-out acceptance at each (0: greedy)
    train: TrainSettings = field(default_factory=TrainSettings)

    def head_config(self, loaded: LoadedModel) -> MTPConfig:
        """The forged head's MTPConfig (its draft vocabulary's size included)."""
        return MTPConfig(layout="sidecar", zero_centered_norms=loaded.config.model_type in ZERO_CENTERED_FAMILIES,
                         features=self.features, head_layers=self.head_layers, draft_vocab=self.draft_vocab,
                         second_mlp=self.second_mlp)


@dataclass
class TrunkInfo:
    loaded: LoadedModel
    sha256: str
    name: str


def load_trunk(model: str | Path | None, device=None, dtype=None) -> TrunkInfo:
    """The trunk alone (any head beside it is ignored), with the sha256 a sidecar records.
    model None: the default model."""
    from mtplx.loading.checkpoint import load_checkpoint
    from mtplx.loading.hf_dir import sha256_of_weights
    from mtplx.runtime import resolve_device, resolve_dtype

    if model is None:
        from mtplx.loading.default_model import default_model_path

        model = default_model_path()
    path = Path(model).expanduser()
    dev = resolve_device(device)
    # the float trunk: a head learns the trunk's own distribution, not a quantized copy's
    loaded = load_checkpoint(path, device=dev, dtype=resolve_dtype(dtype, dev), allow_unverified_head=True,
                             quantize="none")
    loaded = LoadedModel(loaded.model, None, loaded.tokenizer, loaded.config, loaded.source)
    return TrunkInfo(loaded, sha256_of_weights(path), path.name)


def check_trunk(loaded: LoadedModel, needs_tokenizer: bool) -> None:
    """Fail before any work when forge cannot train a head for this trunk."""
    model_type = loaded.config.model_type
    if model_type not in FORGE_MODEL_TYPES:
        raise UnsupportedModel(
            f"forge cannot train a head for a {model_type!r} trunk; supported: {', '.join(FORGE_MODEL_TYPES)}")
    if needs_tokenizer and loaded.tokenizer is None:
        raise ForgeError(
            f"{loaded.source} has no tokenizer, so forge cannot turn its text prompts into tokens; "
            "give a model with tokenizer files, or a --prompts file of token-id lists")
    if needs_tokenizer and not loaded.tokenizer.has_chat_template:
        raise ForgeError(f"{loaded.source} has no chat template; forge's prompt set is chat turns")


def encode_prompts(loaded: LoadedModel, prompts: list) -> list[list[int]]:
    """Chat-template text prompts; token-id lists pass through (checked against the vocabulary)."""
    out = []
    vocab = loaded.config.vocab_size
    for p in prompts:
        if isinstance(p, str):
            out.append(loaded.tokenizer.apply_chat_template(prompt_set.as_chat(p)))
        elif isinstance(p, (list, tuple)) and p and all(isinstance(t, int) and 0 <= t < vocab for t in p):
            out.append(list(p))
        else:
            raise ForgeError(f"a prompt must be a string or a non-empty list of token ids below {vocab}, got {p!r:.80}")
    return out


def text_samples(loaded: LoadedModel, files: list[Path], max_len: int) -> list[Sample]:
    """Plain text that exists offline, cut into training sequences (the loss still targets the
    trunk's own distribution at every position, so it stays self-distillation)."""
    samples = []
    for f in files:
        ids = loaded.tokenizer.encode(Path(f).read_text(encoding="utf-8"))
        for i in range(0, len(ids) - 1, max_len):
            chunk = ids[i:i + max_len]
            if len(chunk) >= 8:
                samples.append(Sample(chunk, 1, f"text:{Path(f).name}:{i}"))
    return samples


CPU_GEN_ROWS = 128  # the CPU's default rows
MAX_GEN_ROWS = 2048
GEN_MEMORY_SHARE = 0.5  # of the GPU's free memory, for the generation's KV cache


def generation_rows(settings: BuildSettings, loaded: LoadedModel, longest: int) -> int:
    """Rows decoded together: ``settings.gen_rows`` where given; else on a GPU as many sequences
    of ``longest`` tokens as half its free memory holds in KV cache, up to MAX_GEN_ROWS (a
    decode step there costs nearly the same at 512 and 2,048 rows: SmolLM2's shape in float32
    on an H100 generated 9.9 k tokens/s at 512 rows, 15.8 k at 1,024 and 17.3 k at 2,048,
    docs/forge.md), and 128 on the CPU."""
    if settings.gen_rows is not None:
        return settings.gen_rows
    weight = loaded.model.lm_head.weight
    if weight.device.type != "cuda":
        return CPU_GEN_ROWS
    cfg = loaded.config
    per_token = PagedKVCache.bytes_per_token(cfg.num_kv_layers, cfg.num_key_value_heads, cfg.head_dim,
                                             resolve_kv_dtype(None, weight.device, weight.dtype))
    torch.cuda.empty_cache()  # (an earlier phase's engine may still hold the allocator's blocks)
    free, _ = torch.cuda.mem_get_info(weight.device)
    fits = int(free * GEN_MEMORY_SHARE // (per_token * longest))
    return max(1, min(MAX_GEN_ROWS, fits // 64 * 64 or fits))


def decoding_engine(loaded: LoadedModel, head, rows: int, longest: int, spare: int = 1024) -> Engine:
    """An engine over the trunk (with ``head``, or none) whose KV cache holds ``rows`` sequences
    of ``longest`` tokens, plus ``spare`` slots."""
    return Engine(LoadedModel(loaded.model, head, loaded.tokenizer, loaded.config, loaded.source),
                  kv_cache_tokens=rows * longest + spare, block_size=16)


# -- phases ----------------------------------------------------------------------------------------

def build_self_prompts(loaded: LoadedModel, prefix: str, settings: BuildSettings, work_dir: Path, resume: bool,
                       exclude: list[str], deadline: float | None, log: Callable[[str], None]) -> SelfPrompts:
    """The trunk's own user messages: reused from ``prompts.json`` on --resume once that phase
    ended (so the corpus's prompt list, and its job keys, stay the same), else generated."""
    path = work_dir / "prompts.json"
    if resume and path.is_file():
        store = SelfPrompts.load(path)
        if store.requested != settings.self_prompts:
            raise ForgeError(f"{path} holds a build with --self-prompts {store.requested}; "
                             f"resume it with --self-prompts {store.requested}")
        if store.done:
            log(f"self prompts: resumed, {len(store.prompts)} of {store.requested}")
            return store
    elif resume and (work_dir / "corpus.pt").is_file():
        raise ForgeError(f"the corpus in {work_dir} was generated without self-generated prompts; "
                         "resume it with --self-prompts 0")
    else:
        store = SelfPrompts(settings.self_prompts, prefix, settings.self_prompt_temperature,
                            settings.self_prompt_max_new_tokens, settings.seed)
    longest = len(loaded.tokenizer.encode(prefix, add_special_tokens=False)) + store.max_new_tokens + 16
    rows = generation_rows(settings, loaded, longest)
    engine = decoding_engine(loaded, None, rows, longest)
    bar = tqdm(total=store.requested, initial=len(store.prompts), unit="prompt", desc="forge: self prompts",
               file=sys.stderr, mininterval=_BAR_INTERVAL)

    def progress(s: SelfPrompts, distinct: int, finished: int) -> None:
        bar.update(max(0, min(s.requested, distinct) - bar.n))
        bar.set_postfix(samples=finished)

    generate_self_prompts(engine, store, rows=rows, exclude=exclude, deadline=deadline,
                          save=lambda s: s.save(path), progress=progress)
    bar.close()
    stopped = " (stopped by the time budget)" if store.out_of_time else ""
    log(f"self prompts: kept {len(store.prompts)} of {store.attempts} samples, {store.seconds:.0f}s{stopped}")
    return store


def build_corpus(loaded: LoadedModel, prompt_ids: list[list[int]], settings: BuildSettings, work_dir: Path,
                 resume: bool, extra: list[Sample], deadline: float | None, log: Callable[[str], None],
                 trunk_sha256: str = "") -> Corpus:
    path = work_dir / "corpus.pt"
    corpus = Corpus.load(path) if resume and path.is_file() else Corpus(samples=list(extra))
    weight = loaded.model.lm_head.weight
    corpus.description.update(trunk_sha256=trunk_sha256, temperatures=list(settings.temperatures),
                              max_new_tokens=settings.max_new_tokens, rounds=settings.rounds,
                              training_prompts=len(prompt_ids), seed=settings.seed,
                              generated_on=f"{weight.device.type} {str(weight.dtype).replace('torch.', '')}")
    if corpus.complete:
        log(f"corpus: resumed, complete ({len(corpus.samples)} sequences, {corpus.generated_tokens} tokens)")
        return corpus
    longest = max(len(p) for p in prompt_ids) + settings.max_new_tokens + 16
    rows = generation_rows(settings, loaded, longest)
    corpus.description["gen_rows"] = rows
    engine = decoding_engine(loaded, None, rows, longest, spare=4096)
    jobs = make_jobs(prompt_ids, settings.temperatures, settings.rounds, settings.seed)
    bar = tqdm(total=settings.tokens, initial=min(settings.tokens, corpus.generated_tokens), unit="tok",
               desc="forge: generating", file=sys.stderr, mininterval=_BAR_INTERVAL)

    def progress(c: Corpus) -> None:
        bar.update(max(0, min(settings.tokens, c.generated_tokens) - bar.n))
        bar.set_postfix(seqs=len(c.samples))

    t0 = time.monotonic()
    generate_corpus(engine, jobs, max_new_tokens=settings.max_new_tokens, rows=rows,
                    target_tokens=settings.tokens, corpus=corpus, save=lambda c: c.save(path), deadline=deadline,
                    progress=progress)
    bar.close()
    corpus.description.update(generation_seconds=round(corpus.description.get("generation_seconds", 0)
                                                       + time.monotonic() - t0, 1))
    corpus.save(path)
    stopped = "" if corpus.complete else " (stopped by the time budget; --resume generates more)"
    log(f"corpus: {len(corpus.samples)} sequences, {corpus.generated_tokens} generated tokens{stopped}")
    return corpus


def load_corpus(path: Path, trunk: TrunkInfo) -> Corpus:
    """A corpus an earlier build stored (``corpus.pt``), checked to come from this trunk."""
    if not Path(path).is_file():
        raise ForgeError(f"no corpus at {path}")
    corpus = Corpus.load(Path(path))
    recorded = corpus.description.get("trunk_sha256")
    if recorded and recorded != trunk.sha256:
        raise ForgeError(f"the corpus {path} was generated by trunk sha256 {recorded}, not this trunk's "
                         f"({trunk.sha256}); a head must learn its own trunk's distribution")
    if not any(s.completion_tokens > 0 for s in corpus.samples):
        raise ForgeError(f"the corpus {path} has no completion token to train on")
    return corpus


def load_corpora(paths: list[Path], trunk: TrunkInfo) -> Corpus:
    """Stored corpora trained on as one (each checked as ``load_corpus`` checks it; e.g. one
    generated on a GPU and one on a CPU, from other seeds): their samples in order. One file
    loads as it is; several get a description of the whole (the temperatures of any part, the
    generation seconds summed) with each part's own under ``parts``. The validation split is
    by prompt, so a prompt found in two parts falls on one side with all its samples."""
    parts = [load_corpus(Path(p), trunk) for p in paths]
    if len(parts) == 1:
        return parts[0]
    described = [{"file": str(p), "sequences": len(c.samples), "generated_tokens": c.generated_tokens,
                  **c.description} for p, c in zip(paths, parts)]
    temperatures = sorted({t for d in described for t in d.get("temperatures") or ()})
    seconds = [d.get("generation_seconds") for d in described]
    description = {"trunk_sha256": trunk.sha256, "temperatures": temperatures,
                   "max_new_tokens": max((d.get("max_new_tokens") or 0) for d in described) or None,
                   "rounds": None, "generation_seconds": round(sum(seconds), 1) if None not in seconds else None,
                   "self_prompts": [d.get("self_prompts") for d in described], "parts": described}
    return Corpus([s for c in parts for s in c.samples], all(c.complete for c in parts), description)


def training_batches(loaded: LoadedModel, corpus: Corpus, ts: TrainSettings, layers: tuple[int, ...],
                     log: Callable[[str], None]) -> tuple[list, list]:
    """(train, validation) batches of the corpus, split by prompt, with the trunk's hidden states
    and the outputs of ``layers`` computed once (kept on the device)."""
    train_samples, val_samples = split_samples(corpus.samples)
    t0 = time.monotonic()
    model = loaded.model
    train = [prepare_batch(b, model, ts.max_len, layers)
             for b in make_batches(train_samples, ts.batch_tokens, ts.max_len)]
    val = [prepare_batch(b, model, ts.max_len, layers) for b in make_batches(val_samples, ts.batch_tokens, ts.max_len)]
    if not train:
        raise ForgeError("the corpus has no sequence with a completion token to train on")
    log(f"training: {len(train)} batches, {len(val)} validation batches "
        f"(trunk pass {time.monotonic() - t0:.1f}s)")
    return train, val


def start_head(ts: TrainSettings, trunk: TrunkInfo, mtp: MTPConfig) -> HeadWeights | None:
    """The forged head ``ts.start_from`` names, to continue training from (None where training
    starts afresh): it must have been trained against this trunk (the sidecar's recorded sha256)
    and have the form asked for (features, layers, MLP widths; its draft vocabulary is chosen
    again from the corpus). Its weights' sha256 goes to ``ts.start_sha256`` for the provenance."""
    if not ts.start_from:
        return None
    start = load_sidecar(Path(ts.start_from), trunk.loaded.config, trunk.sha256)
    asked, found = (mtp.features, mtp.head_layers, mtp.second_mlp), (start.mtp.features, start.mtp.head_layers,
                                                                     start.mtp.second_mlp)
    if asked != found:
        raise ForgeError(f"the head in {ts.start_from} has features {found[0]!r}, {found[1]} layer(s), second MLP "
                         f"width {found[2] or 'full'}; this build asks for {asked[0]!r}, {asked[1]}, "
                         f"{asked[2] or 'full'}: continue it with its own form")
    ts.start_sha256 = (start.provenance or {}).get("weights_sha256") or ""
    return start


def train_head(loaded: LoadedModel, batches: tuple[list, list], mtp: MTPConfig, ts: TrainSettings,
               checkpoint: Path | None, resume: bool, deadline: float | None, log: Callable[[str], None],
               start: HeadWeights | None = None) -> Trainer:
    """Train a head of config ``mtp`` on (train, validation) batches until the epochs or ``deadline``,
    from the trunk's own next-token predictor (``init_head``) or from ``start``'s weights."""
    torch.manual_seed(ts.seed)
    model = loaded.model
    train, val = batches
    head = init_head(model, model.lm_head.weight.device, mtp)
    if start is not None:
        weights = {k: v for k, v in start.state_dict.items() if k != "draft_vocab"}
        missing, unexpected = head.load_state_dict(weights, strict=False)
        if missing or unexpected:
            raise ForgeError(f"the head in {start.source} does not fit this form: missing {missing}, "
                             f"unexpected {unexpected}")
    trainer = Trainer(head, model, train, val, ts, checkpoint=checkpoint)
    if resume and trainer.resume():
        log(f"training: resumed at step {trainer.state.step} of {trainer.state.total_steps}")
    bar = tqdm(total=trainer.state.total_steps, initial=trainer.state.step, desc="forge: training",
               file=sys.stderr, mininterval=_BAR_INTERVAL)
    last = {"agree": "-"}

    def on_step(loss: float, agreement: list[float] | None) -> None:
        if agreement is not None:
            last["agree"] = "/".join(f"{a:.2f}" for a in agreement)
        bar.total = trainer.state.total_steps
        bar.update(1)
        bar.set_postfix(tok=f"{trainer.state.tokens_seen / 1e6:.2f}M", loss=f"{loss:.3f}", agree=last["agree"])

    trainer.run(deadline=deadline, on_step=on_step)
    bar.close()
    return trainer


def draft_vocabulary(corpus: Corpus, size: int, vocab_size: int) -> tuple[torch.Tensor, dict]:
    """FR-Spec: the ``size`` token ids most frequent among the corpus's completion tokens (what
    the head predicts), ascending, and their provenance (corpus tokens counted, coverage: the
    share of them inside the vocabulary)."""
    if not 0 < size < vocab_size:
        raise ForgeError(f"--draft-vocab must lie between 1 and the vocabulary size - 1 ({vocab_size - 1}), got {size}")
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for s in corpus.samples:
        counts += torch.bincount(torch.tensor(s.tokens[s.prompt_len:], dtype=torch.long), minlength=vocab_size)
    total = int(counts.sum())
    if total == 0:
        raise ForgeError("the corpus has no completion token to choose a draft vocabulary from")
    top = counts.topk(size).indices  # ties: any order; every id counted once
    ids = top.sort().values
    return ids, {"size": size, "vocab_size": vocab_size, "corpus_tokens": total,
                 "coverage": round(int(counts[ids].sum()) / total, 5), "chosen_from": "corpus completion tokens"}


def head_engine(loaded: LoadedModel, head_weights: dict[str, torch.Tensor], mtp: MTPConfig,
                held_out: list[list[int]], settings: BuildSettings) -> Engine:
    """An engine over the trunk with the head as it will ship (its saved tensors, attached the way
    load() does), its cache sized for ``measure_rows`` held-out prompts."""
    state = {k[len("mtp."):]: v for k, v in head_weights.items()}
    device, dtype = loaded.model.lm_head.weight.device, loaded.model.lm_head.weight.dtype
    head = attach_head(loaded.model, HeadWeights(state, mtp), device, dtype)
    longest = max(len(p) for p in held_out) + settings.measure_max_tokens + settings.measure_depth + 16
    return decoding_engine(loaded, head, settings.measure_rows, longest)


def measure_head(loaded: LoadedModel, head_weights: dict[str, torch.Tensor], mtp: MTPConfig,
                 held_out: list[list[int]], settings: BuildSettings) -> dict:
    """Acceptance of the head as it will ship (its saved tensors, attached the way load() does)
    on the held-out prompts at each of ``settings.measure_temperatures``
    (``measure.acceptance_by_temperature``: greedy, and sampled with mirror drafts)."""
    engine = head_engine(loaded, head_weights, mtp, held_out, settings)
    device, dtype = engine.device, loaded.model.lm_head.weight.dtype
    out = acceptance_by_temperature(engine, held_out, temperatures=settings.measure_temperatures,
                                    depth=settings.measure_depth, max_tokens=settings.measure_max_tokens,
                                    rows=settings.measure_rows, seed=settings.seed)
    for report in ([out["greedy"]] if "greedy" in out else []) + list(out["sampled"].values()):
        report.update(device=str(device), dtype=str(dtype).replace("torch.", ""))
    return out


# -- the whole build -------------------------------------------------------------------------------

def build(trunk: TrunkInfo, out_dir: Path | None, *, train_prompts: list, held_out_prompts: list,
          settings: BuildSettings, work_dir: Path | None = None, resume: bool = False,
          text_files: list[Path] = (), prompt_source: str = prompt_set.PROMPT_SET_VERSION, command: str = "",
          corpus_files: Sequence[Path] = (), corpus_only: bool = False,
          log: Callable[[str], None] | None = None) -> dict:
    """Forge a head for ``trunk`` into ``out_dir``; returns the provenance written beside it.
    corpus_files: train on these stored corpora, as one (no prompts, no generation);
    corpus_only: stop after the corpus (``work_dir/corpus.pt``; returns its description)."""
    log = log or (lambda line: print(f"forge: {line}", file=sys.stderr))
    loaded = trunk.loaded
    needs_tokenizer = any(isinstance(p, str) for p in list(train_prompts) + list(held_out_prompts)) or bool(text_files)
    check_trunk(loaded, needs_tokenizer)
    if not train_prompts or not held_out_prompts:
        raise ForgeError("forge needs at least one training prompt and one held-out prompt")
    if corpus_files and (corpus_only or settings.self_prompts or text_files):
        raise ForgeError("--corpus trains on a stored corpus: it takes no --corpus-only, --self-prompts or --text")
    mtp = settings.head_config(loaded)
    feature_layers(mtp.features, loaded.config.num_hidden_layers)  # an unknown choice fails before any work
    if mtp.second_mlp and mtp.head_layers < 2:
        raise ForgeError("a second layer's MLP width (--second-mlp) needs a head of two layers (--head-layers 2)")
    prefix = user_turn_prefix(loaded.tokenizer) if settings.self_prompts else None  # fails before any work
    continued = start_head(settings.train, trunk, mtp)  # likewise
    if work_dir is None and out_dir is None:
        raise ForgeError("give a work folder (--work) for the corpus")
    work_dir = Path(work_dir or Path(out_dir) / "forge-work")
    _prepare_work_dir(work_dir, resume, stored_corpus=bool(corpus_files))
    start = time.monotonic()
    deadline = (lambda share: start + share * settings.max_seconds) if settings.max_seconds else (lambda share: None)

    self_prompts = None
    train_ids: list[list[int]] = []
    if corpus_files:
        corpus = load_corpora(list(corpus_files), trunk)
        log(f"corpus: {len(corpus.samples)} sequences, {corpus.generated_tokens} generated tokens from "
            f"{', '.join(map(str, corpus_files))}")
    else:
        if settings.self_prompts:
            exclude = [p for p in list(held_out_prompts) + list(train_prompts) if isinstance(p, str)]
            self_prompts = build_self_prompts(loaded, prefix, settings, work_dir, resume, exclude,
                                              deadline(settings.self_prompt_share), log)
        elif resume and (work_dir / "prompts.json").is_file():
            raise ForgeError(f"{work_dir} holds a build with self-generated prompts (prompts.json); "
                             "resume it with the --self-prompts it was started with")
        all_prompts = interleave(list(train_prompts), self_prompts.prompts) if self_prompts else list(train_prompts)
        train_ids = encode_prompts(loaded, all_prompts)
        extra = text_samples(loaded, text_files, settings.train.max_len) if text_files else []
        corpus = build_corpus(loaded, train_ids, settings, work_dir, resume, extra,
                              (start + settings.max_seconds) if corpus_only and settings.max_seconds
                              else deadline(GEN_PHASE), log, trunk.sha256)
        corpus.description["self_prompts"] = self_prompts.description() if self_prompts else None
        corpus.save(work_dir / "corpus.pt")
        if corpus_only:
            log(f"wrote {work_dir / 'corpus.pt'}")
            return corpus.description
    held_ids = encode_prompts(loaded, held_out_prompts)
    batches = training_batches(loaded, corpus, settings.train, mtp_layers(mtp, loaded), log)
    trainer = train_head(loaded, batches, mtp, settings.train, work_dir / "train.pt", resume, deadline(TRAIN_PHASE),
                         log, continued)
    weights = head_state(trainer.head, torch.bfloat16)
    vocab = None
    if mtp.draft_vocab:
        ids, vocab = draft_vocabulary(corpus, mtp.draft_vocab, loaded.config.vocab_size)
        weights["mtp.draft_vocab"] = ids.to(torch.int32)
        log(f"draft vocabulary: {vocab['size']} tokens cover {vocab['coverage']:.3f} of the corpus's")
    save_file(weights, str(work_dir / "trained_head.safetensors"))  # survives a failure in what follows
    measured = measure_head(loaded, weights, mtp, held_ids, settings)
    log("held-out acceptance by depth " + acceptance_line(measured) + f" at depth {settings.measure_depth}")
    provenance = provenance_of(trunk, trainer, corpus, measured, settings, mtp, vocab, train_ids, self_prompts,
                             text_files, prompt_source, command, corpus_files, time.monotonic() - start)
    write_head(Path(out_dir), weights, provenance)
    log(f"wrote {Path(out_dir) / 'mtp.safetensors'} and mtplx_forge.json")
    return provenance


def mtp_layers(mtp: MTPConfig, loaded: LoadedModel) -> tuple[int, ...]:
    """The trunk layers a head of config ``mtp`` reads (``MTPHead.trunk_layers``)."""
    return feature_layers(mtp.features, loaded.config.num_hidden_layers)


def _prepare_work_dir(work_dir: Path, resume: bool, stored_corpus: bool = False) -> None:
    """Refuse a work folder an earlier build left files in, unless resuming it (with a stored
    corpus given, only its training checkpoint counts)."""
    names = ("train.pt",) if stored_corpus else ("prompts.json", "corpus.pt", "train.pt")
    leftovers = [work_dir / name for name in names if (work_dir / name).is_file()]
    if leftovers and not resume:
        raise ForgeError(f"{work_dir} holds an earlier build ({', '.join(p.name for p in leftovers)}); "
                         "pass --resume to continue it, or delete the folder to start over")
    work_dir.mkdir(parents=True, exist_ok=True)


def provenance_of(trunk: TrunkInfo, trainer: Trainer, corpus: Corpus, measured: dict, settings: BuildSettings,
                mtp: MTPConfig, vocab: dict | None, train_ids: list[list[int]], self_prompts: SelfPrompts | None,
                text_files, prompt_source: str, command: str, corpus_files: Sequence[Path],
                seconds: float) -> dict:
    cfg = trunk.loaded.config
    st = trainer.state
    device = trunk.loaded.model.lm_head.weight.device
    text_tokens = sum(len(s.tokens) for s in corpus.samples if s.key.startswith("text:"))
    described = corpus.description
    data = {"prompt_set": prompt_source, "training_prompts": len(train_ids) or described.get("training_prompts"),
            "self_prompts": self_prompts.description() if self_prompts else described.get("self_prompts"),
            "sequences": len(corpus.samples), "generated_tokens": corpus.generated_tokens,
            "temperatures": described.get("temperatures", list(settings.temperatures)),
            "max_new_tokens": described.get("max_new_tokens", settings.max_new_tokens),
            "rounds": described.get("rounds", settings.rounds),
            "generation_seconds": described.get("generation_seconds"),
            "text_files": [Path(f).name for f in text_files], "text_tokens": text_tokens,
            "validation_split": "by prompt",
            "corpus_file": ", ".join(map(str, corpus_files)) if corpus_files else None,
            "corpus_parts": described.get("parts")}
    return {
        "trunk_sha256": trunk.sha256,
        "trunk": {"name": trunk.name, "model_type": cfg.model_type, "hidden_size": cfg.hidden_size,
                  "num_hidden_layers": cfg.num_hidden_layers, "num_attention_heads": cfg.num_attention_heads,
                  "num_key_value_heads": cfg.num_key_value_heads, "vocab_size": cfg.vocab_size},
        "head": {"layout": "qwen3_5 (fc over [norm(embed(t+1)), norm(features_t)], decoder layers, norm; "
                           "embedding and lm_head shared with the trunk)",
                 "features": mtp.features, "feature_layers": list(mtp_layers(mtp, trunk.loaded)),
                 "num_layers": mtp.head_layers, "draft_vocab": vocab,
                 "mlp_widths": [layer.mlp.down_proj.in_features for layer in trainer.head.layers],
                 "parameters": sum(p.numel() for p in trainer.head.parameters())},
        "training": {**asdict(settings.train), "objective": "KL(trunk next-token distribution || head) at every "
                                                            "depth, completion tokens, depths weighted; each depth "
                                                            "fed the head's own earlier output",
                     "steps": st.step, "planned_steps": st.total_steps, "target_tokens_seen": st.tokens_seen,
                     "seconds": round(st.seconds, 1), "device": str(device), "dtype_trunk": str(trunk.loaded.model.lm_head.weight.dtype).replace("torch.", ""),
                     "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
                     "validation_agreement_by_depth": st.history[-1]["agreement"] if st.history else None,
                     "history": st.history[-20:]},
        "data": data,
        "measured": {"held_out": measured.get("greedy"), "held_out_sampled": measured["sampled"],
                     "sampled_draft_policy": "mirror"},
        "built": {"date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "mtplx_version": __version__,
                  "torch": torch.__version__, "command": command, "seconds": round(seconds, 1)},
    }


def load_prompts_file(path: Path) -> list:
    """A JSON list of prompts (strings, or token-id lists for trunks without a tokenizer)."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise ForgeError(f"cannot read prompts file {path}: {exc}") from exc
    if not isinstance(data, list) or not data:
        raise ForgeError(f"{path} must hold a non-empty JSON list of prompts")
    return data
