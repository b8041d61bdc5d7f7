"""The public engine: ``mtplx.load(...)`` returns an ``Engine`` with ``generate`` and ``stream``."""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, field
from typing import Any, Iterable, Iterator, Sequence as Seq

import torch

from mtplx.engine.adaptive_depth import DEFAULT_MAX_DEPTH, AutoDepth, DepthCosts, head_priors
from mtplx.engine.faults import FaultHook
from mtplx.engine.generator import Generator, StepResult
from mtplx.engine.kv_allocator import KVAllocator
from mtplx.engine.runner import ModelRunner
from mtplx.engine.sampling import NoiseStream, SamplingParams
from mtplx.engine.sequence import Sequence
from mtplx.engine.tensor_parallel import TensorParallel
from mtplx.errors import ContextLengthExceeded, InvalidParameter
from mtplx.loading.checkpoint import LoadedModel
from mtplx.models.layers import fuse_projections
from mtplx.runtime import resolve_kv_dtype

MAX_DEPTH = 8
DEFAULT_DEPTH = 1  # the shipped head's fastest depth on a 2-core CPU; `mtplx tune` finds yours
DRAFT_POLICIES = ("auto", "greedy", "mirror")
# draft_policy="auto" (the default): drafts sampled from the head's distribution ("mirror",
# sampling.draft_params) from this temperature up, argmax drafts ("greedy") below. H200, 12
# held-out chat prompts, depth 1, session 13 (benchmarks/results/gpu_h200_s13_*.json): through
# engine.generate mirror and argmax run even at temperature 0.7 with top-p 0.95 (1.27x vs 1.25x
# AR, acceptance 0.54 vs 0.48) and mirror wins at 1.0 (1.19x vs 1.07x); through the scheduler
# at 0.7 argmax wins (mtp_batch at 1 / 4 / 8 streams 1,581 / 4,619 / 8,380 tok/s against mirror's
# 1,526 / 4,405 / 7,797; one client's 12 requests in turn 1,643 vs 1,598), at 0.9 with top-p
# 0.95 mirror does (1,513 / 4,300 / 8,018 against 1,498 / 4,262 / 7,853; 1,599 vs 1,511).
MIRROR_FROM_TEMPERATURE = 0.85
# The CPU's (session 28, `benchmarks/cpu_sampled.py`: the 12 held-out chat prompts, 96 tokens,
# two threads, depth 1, MTP / AR with argmax vs mirror drafts, two or three rounds of seeds):
# T 0.4 1.104x / 1.114x, T 0.55 1.093x / 1.087x, T 0.7 1.074x / 1.119x and 1.078x / 1.117x,
# T 1.0 0.949x / 1.076x (results/cpu_s28_sampled_*.json). Mirror drafts cost a softmax over the
# head's logits and a race each (about 0.15 ms on that CPU), which their acceptance (1.57 against
# 1.46 tokens a cycle at 0.7) repays from about 0.6.
CPU_MIRROR_FROM_TEMPERATURE = 0.6


# Before `mtplx tune`, a request that names no mode decodes MTP only where it is expected to beat
# AR by this much (``Engine.mtp_estimate``), and one that names no depth leaves the default
# depth only for one expected this much faster (``Engine.request_depth``). On an AVX2 CPU (session
# 34: the 12 held-out chat prompts, `benchmarks/cpu_sampled.py --rounds 3`,
# cpu_s34_avx2_{estimate_ab,estimate_margin_ab,low_temperatures}_2threads.json) the estimate of
# depth 1 read from 3.5% above to 3.5% below the measured ratios: greedy 1.071 against 1.051 /
# 1.071 / 1.067 / 1.076x, T 0.3 1.028 against 1.040x, T 0.5 1.018 against 1.002x, T 0.7 1.008
# against 0.989 / 0.974 / 1.011 / 1.044x, T 1.0 0.974 against 0.952 / 0.952 / 0.961 / 0.937x. At
# 1.02 the estimate picks the faster of MTP and AR at each of these temperatures (MTP up to about
# T 0.45, AR where depth 1 measured even or behind); 1.03 sent T 0.3 to AR, 4% behind depth 1.
# Since session 35 (one activation scale per row on AVX2, cheaper verifies, the AVX2 table
# measured again) the estimate reads greedy 1.086, T 0.7 1.077, T 1.0 1.041 (MTP at each), and
# depth 1 measured 1.166 / 1.072 / 1.014x AR (cpu_s35_avx2_final_ab_2threads.json).
MIN_EXPECTED_SPEEDUP = 1.02


def cost_machine(device: torch.device) -> str:
    """Which default cycle-cost table (``DepthCosts.default``) prices this device's cycles:
    "cuda"; "cpu" (AVX-512) or "cpu-avx2" where the CPU kernels run 512 or 256 bits wide; else
    "cpu-torch" (PyTorch's own ops: no table was measured there; auto takes the "cpu" one and
    untuned requests do not follow the estimate, ``Engine.estimates``)."""
    if device.type == "cuda":
        return "cuda"
    from mtplx.kernels import cpu as cpu_kernels

    if not cpu_kernels.available():
        return "cpu-torch"
    return "cpu-avx2" if cpu_kernels.vector_width() == 256 else "cpu"


def mirror_from(device_type: str) -> float:
    """The temperature from which draft_policy "auto" samples drafts from the head (mirror)."""
    return MIRROR_FROM_TEMPERATURE if device_type == "cuda" else CPU_MIRROR_FROM_TEMPERATURE


@dataclass
class GenerationResult:
    token_ids: list[int]
    text: str
    finish_reason: str
    stats: dict = field(default_factory=dict)
    prompt_tokens: int = 0


@dataclass
class Request:
    """A validated generation request (what the scheduler modes queue and run)."""

    prompt_ids: list[int]
    params: SamplingParams
    max_tokens: int
    mode: str
    depth: int  # the draft depth; with adaptive, the deepest a cycle may draft
    draft_policy: str
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    grammar: Any = None  # constraints.Grammar: decode only text it accepts (None: unconstrained)
    logprobs: int | None = None  # report each token's logprob and this many alternatives (None: off)
    prompt_logprobs: int | None = None  # the same for the prompt's tokens (prompt scoring; None: off)
    adaptive: bool = False  # depth="auto": each cycle's depth chosen from the acceptance of its rows (adaptive_depth.py)
    mtp_disabled_reason: str | None = None  # why a request that named no mode decodes AR on a model with a head


class Engine:
    """One model, one KV cache, one decode step. Not thread-safe: one owner thread drives it."""

    def __init__(self, loaded: LoadedModel, *, depth: int | None = None, kv_cache_tokens: int = 16384,
                 block_size: int = 16, cuda_graphs: bool = True, chain: bool | None = None,
                 default_mode: str | None = None, sampled_mode: str | None = None,
                 sampled_depth: int | str | None = None, max_depth: int = DEFAULT_MAX_DEPTH,
                 depth_costs: DepthCosts | None = None, sampled_depth_costs: DepthCosts | None = None,
                 tensor_parallel: TensorParallel | None = None, kv_dtype=None,
                 estimated: Iterable[str] = ()):
        """chain: launch each greedy cycle before the host reads the last one (chain.py); None:
        where CUDA graphs replay the cycles (on the CPU the eager chain only costs host time).
        default_mode: "ar" or "mtp" for requests that name none (None: mtp when the model
        has a head; ``mtplx.load`` passes "ar" where ``mtplx tune`` found MTP slower).
        sampled_mode, sampled_depth: the same for requests with temperature > 0 (None: as
        greedy ones, default_mode and depth); ``mtplx.load`` passes the sampled tuning.
        depth, sampled_depth: 1..MAX_DEPTH or "auto" (each row picks each cycle's depth up to
        max_depth, from its own acceptance and depth_costs: the cycle costs ``mtplx tune``
        measured, or the device's defaults; sampled_depth_costs: those of sampled cycles).
        tensor_parallel: rank 0's handle on the other ranks (``tensor_parallel.launch``, which
        also gave ``loaded``, rank 0's slice): every forward is mirrored on them; no CUDA graphs.
        kv_dtype: the KV cache's element type (``runtime.resolve_kv_dtype``: by default float16
        on the CPU for a float32 model, else the model's dtype).
        estimated: the regimes ("greedy", "sampled") whose requests follow the estimate
        (``estimates``): where they name no depth (and ``depth`` is not given), the depth the
        head's recorded acceptance and this machine's cycle costs expect to be fastest, and where
        they name no mode, AR when MTP is expected to lose (``mtp_estimate``). ``mtplx.load``
        names both where `mtplx tune` has no verdict for the model; by default none."""
        for name, value in (("default_mode", default_mode), ("sampled_mode", sampled_mode)):
            if value not in (None, "ar", "mtp"):
                raise InvalidParameter(name, f"must be 'ar' or 'mtp', got {value!r}")
        if sampled_depth is not None:
            self.check_depth(sampled_depth, "sampled_depth")
        self.check_depth(max_depth, "max_depth", allow_auto=False)
        self.loaded = loaded
        self.config = loaded.config
        self.tokenizer = loaded.tokenizer
        self.device = loaded.model.model.embed_tokens.weight.device  # lm_head may be quantized
        self.dtype = loaded.model.model.embed_tokens.weight.dtype
        num_blocks = max(2, -(-kv_cache_tokens // block_size))
        if self.device.type == "cuda":  # fewer, larger matmuls per step
            fuse_projections(loaded.model)
            if loaded.head is not None:
                fuse_projections(loaded.head)
        self.max_context = min(self.config.max_position_embeddings, num_blocks * block_size)
        self.runner = ModelRunner(loaded.model, loaded.head, num_blocks=num_blocks, block_size=block_size,
                                  kv_dtype=resolve_kv_dtype(kv_dtype, self.device, self.dtype))
        self.tensor_parallel = tensor_parallel
        if tensor_parallel is not None and loaded.head is not None and loaded.head.mtp.features != "final":
            tensor_parallel.close()  # the ranks do not yet mirror a fused-feature head's forwards
            raise InvalidParameter(
                "tensor_parallel", f"this MTP head reads {loaded.head.mtp.features!r} trunk features (forge "
                "--features), which tensor parallel does not support yet: use tensor_parallel=1, or a head "
                "forged with --features final")
        if tensor_parallel is not None:  # before the allocator takes the runner's state cache
            tensor_parallel.mirror(self.runner)
        if self.device.type == "cuda" and cuda_graphs and tensor_parallel is None:
            from mtplx.engine.cuda_graphs import GraphCache

            self.runner.graphs = GraphCache(self.runner, max_context=self.max_context)
        self.kv = KVAllocator(self.runner.blocks, self.runner.states, self.max_context)
        eos = set(self.tokenizer.eos_token_ids) if self.tokenizer else set(self.config.eos_token_ids)
        chain = self.runner.graphs is not None if chain is None else chain
        self.generator = Generator(self.runner, self.kv, eos, chain=chain)
        self.default_depth = self.check_depth(depth) if depth is not None else DEFAULT_DEPTH
        self.depth_given = depth is not None
        self.cost_machine = cost_machine(self.device)
        self.costs_source = "tuned" if depth_costs is not None else f"{self.cost_machine} defaults"
        if depth_costs is None:  # not tuned: the device's tables, greedy and sampled cycles apart
            depth_costs = DepthCosts.default(self.cost_machine)
            sampled_depth_costs = sampled_depth_costs or DepthCosts.default_sampled(self.cost_machine)
        else:  # tune times one row: a batch's cycles grow as the device's defaults measured
            depth_costs = depth_costs.grown_as(DepthCosts.default(self.cost_machine))
            if sampled_depth_costs is not None:
                sampled_depth_costs = sampled_depth_costs.grown_as(DepthCosts.default_sampled(self.cost_machine))
        # MTP rows' AR steps run unchained (generator._cycle); on CUDA, where AR steps chain and
        # no table grows with width, auto keeps drafting (not measured there)
        self.auto_depth = AutoDepth(max_depth, depth_costs, sampled_depth_costs,
                                    measured=head_priors(loaded.head_info.get("provenance")),
                                    ar_steps=self.device.type == "cpu")
        self.estimated = frozenset(estimated) if self.cost_machine != "cpu-torch" else frozenset()
        self.default_mode = default_mode
        self.sampled_mode, self.sampled_depth = sampled_mode, sampled_depth
        self.runner.compile_kernels()
        if self.runner.graphs is not None:  # capture now: the first request runs as fast as the rest
            deepest = max(3, max_depth, *(d for d in (self.default_depth, sampled_depth) if isinstance(d, int)))
            self.runner.graphs.capture_all(depths=tuple(range(1, deepest + 1)))
            if self.generator.beside == "auto":  # prompts that arrive at a running chain run beside it
                self.runner.graphs.enable_side()

    @property
    def has_mtp(self) -> bool:
        return self.loaded.head is not None

    @property
    def fault_hook(self) -> FaultHook | None:
        """``hook(point, seq)``, called on the model thread before each per-request stage
        (faults.FAULT_POINTS); an exception it raises fails that request alone ("forward":
        every request of that step), as a real fault there would. For tests and chaos drills;
        set it before the requests it targets. None (the default) costs nothing."""
        return self.generator.fault_hook

    @fault_hook.setter
    def fault_hook(self, hook: FaultHook | None) -> None:
        self.generator.inject_faults(hook)

    # -- request building ------------------------------------------------------------------
    def encode_prompt(self, prompt, *, chat: bool = False) -> list[int]:
        """A string, a list of token ids, or (chat=True) a list of {"role", "content"} messages."""
        if isinstance(prompt, (list, tuple)) and (not prompt or all(isinstance(t, int) for t in prompt)) and not chat:
            ids = [int(t) for t in prompt]
            bad = [t for t in ids if not 0 <= t < self.config.vocab_size]
            if bad:
                raise InvalidParameter("prompt", f"token id {bad[0]} outside [0, {self.config.vocab_size})")
        else:
            if self.tokenizer is None:
                raise InvalidParameter(
                    "prompt", "this model has no tokenizer files, so only token-id prompts (a list of ints) work")
            if chat:
                _check_messages(prompt)
                ids = self.tokenizer.apply_chat_template(list(prompt), add_generation_prompt=True)
            elif isinstance(prompt, str):
                _check_text(prompt, "prompt")
                ids = self.tokenizer.encode(prompt)
            else:
                raise InvalidParameter("prompt", "expected a string, a list of token ids, or chat messages with chat=True")
        if not ids:
            raise InvalidParameter("prompt", "the prompt is empty")
        if len(ids) >= self.max_context:
            raise ContextLengthExceeded(
                "prompt", f"the prompt has {len(ids)} tokens; this model's context is {self.max_context} tokens, "
                          "and at least one must be left for the output")
        return ids

    def make_request(self, prompt, *, mode: str | None = None, depth: int | str | None = None, max_tokens: int = 256,
                     temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0, min_p: float = 0.0,
                     presence_penalty: float = 0.0, frequency_penalty: float = 0.0, seed: int | None = None,
                     stop: str | Seq[str] | None = None, chat: bool = False, draft_policy: str = "auto",
                     ignore_eos: bool = False) -> Request:
        """Validate every parameter and tokenise the prompt (errors name the parameter).

        A request that names no mode (or depth) gets the engine's default; a sampled one
        (temperature > 0) the sampled default where the engine has one (``mtplx tune``). On an
        untuned engine that follows the estimate (``estimated``), a request naming no depth takes
        ``request_depth``'s, and one naming no mode decodes AR where ``mtp_estimate`` at its
        depth (the named one, if any): the scheduler modes that batch MTP only (mtp_batch,
        solo_mtp) refuse such a request, so callers of those name mode="mtp" (the server does).
        depth: 1..MAX_DEPTH, or "auto" (adaptive, up to the engine's ``max_depth``)."""
        params = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p,
                                presence_penalty=presence_penalty, frequency_penalty=frequency_penalty, seed=seed)
        params.validate(self.config.vocab_size)
        default_mode = self.default_mode if params.greedy else self.sampled_mode or self.default_mode
        default_depth = self.request_depth(params.temperature)
        named_mode = mode
        mode = mode or (default_mode if self.has_mtp else None) or ("mtp" if self.has_mtp else "ar")
        if mode not in ("ar", "mtp"):
            raise InvalidParameter("mode", f"{mode!r} is not one of 'ar', 'mtp'")
        if mode == "mtp" and not self.has_mtp:
            raise InvalidParameter(
                "mode", "this model has no MTP head, so only mode='ar' works (forge one with `mtplx forge build`)")
        if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
            raise InvalidParameter("max_tokens", f"must be an integer >= 1, got {max_tokens!r}")
        if draft_policy not in DRAFT_POLICIES:
            raise InvalidParameter("draft_policy", f"{draft_policy!r} is not one of {', '.join(DRAFT_POLICIES)}")
        if draft_policy == "auto":
            draft_policy = "mirror" if params.temperature >= mirror_from(self.device.type) else "greedy"
        depth = self.check_depth(depth) if depth is not None else default_depth
        adaptive = depth == "auto"
        depth = self.auto_depth.max_depth if adaptive else depth
        reason = None
        if named_mode is None and mode == "ar" and self.has_mtp:  # the engine's default (mtplx tune's verdict)
            regime = "greedy" if params.greedy else "sampled"
            reason = (f"this engine's default for {regime} requests is AR (what `mtplx tune` saves where no MTP "
                      "depth beat AR on this machine); generation_mode mtp asks for MTP")
        estimate = self.mtp_estimate(params.temperature, "auto" if adaptive else depth) \
            if mode == "mtp" and named_mode is None else None
        if estimate is not None and estimate[1] < MIN_EXPECTED_SPEEDUP:  # MTP expected to lose
            best, speedup = estimate
            mode, reason = "ar", (
                f"not tuned (`mtplx tune`): at temperature {params.temperature:g} the head's recorded acceptance and "
                f"the cycle costs ({self.costs_source}) expect MTP depth {best} at "
                f"{speedup:.2f}x AR, under {MIN_EXPECTED_SPEEDUP:.2f}x; generation_mode mtp asks for it")
        for name, flag in (("chat", chat), ("ignore_eos", ignore_eos)):
            if not isinstance(flag, bool):  # "false" would be true
                raise InvalidParameter(name, f"must be True or False, got {flag!r}")
        if stop is not None and not isinstance(stop, (str, list, tuple)):
            raise InvalidParameter("stop", f"expected a string or a list of strings, got {stop!r}")
        stops = (stop,) if isinstance(stop, str) else tuple(stop or ())
        if any(not isinstance(s, str) or not s for s in stops):
            raise InvalidParameter("stop", "each stop sequence must be a non-empty string")
        return Request(self.encode_prompt(prompt, chat=chat), params, max_tokens, mode,
                       depth if mode == "mtp" else 0, draft_policy, stops, ignore_eos,
                       adaptive=adaptive and mode == "mtp", mtp_disabled_reason=reason)

    def request_depth(self, temperature: float) -> int | str:
        """The depth of a request at ``temperature`` that names none: a sampled one the sampled
        default where there is one; else the engine's depth where it was given one; else, where
        requests follow the estimate (``estimates``), its best depth where that promises
        ``MIN_EXPECTED_SPEEDUP`` times the default depth's speed-up; else ``DEFAULT_DEPTH``."""
        if temperature > 0 and self.sampled_depth:
            return self.sampled_depth
        if not self.depth_given and self.estimates(temperature):
            best, speedup = self.auto_depth.expected_speedup(temperature)
            default = self.auto_depth.expected_speedup(temperature, self.default_depth)[1]
            if speedup >= default * MIN_EXPECTED_SPEEDUP:  # a clear gain over the default depth
                return best
        return self.default_depth

    def estimate_summary(self) -> str | None:
        """What requests naming no mode or depth decode where they follow the estimate, greedy
        and at temperatures 0.7 and 1.0, e.g. "greedy: MTP depth 1 (1.07x AR expected); T 0.7: AR
        (1.01x)"; None where none follows it."""
        parts = []
        for label, t in (("greedy", 0.0), ("T 0.7", 0.7), ("T 1.0", 1.0)):
            if not self.has_mtp or not self.estimates(t):
                continue
            depth = self.request_depth(t)
            best, speedup = self.mtp_estimate(t, depth)
            mode = "AR" if speedup < MIN_EXPECTED_SPEEDUP else f"MTP depth {'auto' if depth == 'auto' else best}"
            parts.append(f"{label}: {mode} ({speedup:.2f}x AR expected)")
        return "; ".join(parts) or None

    def estimates(self, temperature: float) -> bool:
        """Whether requests at ``temperature`` follow the estimate (``AutoDepth.expected_speedup``):
        their regime is one of ``estimated`` (untuned) and the head records its own acceptance
        for it. Such a request that names no depth takes the estimate's best depth, unless the
        engine was given one; one that names no mode decodes AR where ``mtp_estimate`` expects MTP to lose."""
        regime = "greedy" if temperature <= 0 else "sampled"
        return regime in self.estimated and self.auto_depth.measured_for(temperature)

    def mtp_estimate(self, temperature: float, depth: int | str) -> tuple[int, float] | None:
        """(depth, expected speed-up over AR) of an MTP request at ``temperature`` and ``depth``
        ("auto": the best depth up to max_depth), under the head's recorded acceptance and this
        machine's cycle costs, where requests at ``temperature`` follow the estimate; else None.
        A request naming no mode decodes AR where the speed-up is below ``MIN_EXPECTED_SPEEDUP``."""
        if not self.estimates(temperature):
            return None
        return self.auto_depth.expected_speedup(temperature, None if depth == "auto" else depth)

    @staticmethod
    def check_depth(depth, name: str = "depth", allow_auto: bool = True) -> int | str:
        if depth == "auto" and allow_auto:
            return depth
        if not isinstance(depth, int) or isinstance(depth, bool) or not 1 <= depth <= MAX_DEPTH:
            also = ", or 'auto'" if allow_auto else ""
            raise InvalidParameter(name, f"must be an integer from 1 to {MAX_DEPTH}{also}, got {depth!r}")
        return depth

    def new_sequence(self, req: Request) -> Sequence:
        plan = self.auto_depth.plan(req.params.temperature) if req.adaptive and req.mode == "mtp" else None
        return Sequence(prompt_ids=req.prompt_ids, params=req.params, max_tokens=req.max_tokens,
                        noise=NoiseStream(req.params.seed), mode=req.mode,
                        depth=plan.first_depth if plan else req.depth, depth_plan=plan,
                        draft_policy=req.draft_policy, ignore_eos=req.ignore_eos,
                        constraint=req.grammar.matcher() if req.grammar is not None else None,
                        logprobs=None if req.logprobs is None else [], top_logprobs=req.logprobs or 0,
                        prompt_logprobs=None if req.prompt_logprobs is None else [],
                        prompt_top_logprobs=req.prompt_logprobs or 0)

    # -- running ------------------------------------------------------------------------------
    def run(self, req: Request, text: TextTracker | None = None) -> Iterator[tuple[Sequence, str]]:
        """Decode one request alone (serial path); yields (sequence, new text) after each step.
        The final text honours stop strings; blocks are returned when the generator closes.
        text: the request's ``text_tracker`` where the caller reads it too (its ``shown``)."""
        seq = self.new_sequence(req)
        text = text or self.text_tracker(req)
        with torch.inference_mode():
            self.generator.admit(seq)  # holds nothing if it raises
            try:
                self.generator.prefill(seq)
                yield seq, text.update(seq)
                while not seq.finished:
                    failed = self.step([seq]).failed
                    if failed:
                        raise failed[seq.seq_id]
                    yield seq, text.update(seq)
            finally:
                self.generator.release(seq)

    def release_all(self) -> None:
        """Give back every sequence's KV blocks and state slot and drop the cycle in flight
        (the scheduler's recovery after its policy raised)."""
        self.generator.release_all()

    def text_tracker(self, req: Request) -> TextTracker:
        """The detokeniser of one request's output (stop strings applied)."""
        return TextTracker(self.tokenizer, req.stop, len(req.prompt_ids), self.generator.fault_hook)

    def step(self, seqs: list[Sequence]) -> StepResult:
        """One decode step for rows of the same mode; ends rows that hit the context limit.
        Returns the rows it advanced and the rows whose own work failed (the others stepped);
        an exception from a batched forward propagates (no row can be blamed)."""
        for seq in seqs:  # (an MTP row near the end drafts less: Generator.next_depths)
            if len(seq.tokens) >= self.max_context:
                seq.finish_reason = "length"
        live = [s for s in seqs if not s.finished]
        return self.generator.step(live) if live else StepResult()

    def generate(self, prompt, **kwargs) -> GenerationResult:
        """Generate a completion. See ``make_request`` for the parameters."""
        req = self.make_request(prompt, **kwargs)
        pieces = []
        for seq, piece in self.run(req):
            pieces.append(piece)
        result = self.result(seq, "".join(pieces))
        result.stats["mtp_disabled_reason"] = req.mtp_disabled_reason
        return result

    def stream(self, prompt, **kwargs) -> Iterator[str]:
        """Text pieces as tokens commit (several tokens per piece under MTP). The request is
        checked here, so a bad parameter raises at the call, not at the first piece."""
        req = self.make_request(prompt, **kwargs)
        return (piece for _, piece in self.run(req) if piece)

    def result(self, seq: Sequence, text: str) -> GenerationResult:
        stats = seq.stats.as_dict()
        stats["mode"] = seq.mode
        return GenerationResult(seq.generated, text, seq.finish_reason or "length", stats, len(seq.prompt_ids))


def _check_text(text: str, name: str) -> None:
    """Text the tokenizer takes: a lone surrogate (no Unicode character) is refused by name."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidParameter(name, f"not valid Unicode text at character {exc.start}: {exc.reason}") from None


def _check_messages(messages) -> None:
    """Chat messages as templates read them: a non-empty list of {"role": str, "content": ...},
    the content a string, a list of parts, or (an assistant's message with tool calls) None."""
    shape = "with chat=True the prompt is a non-empty list of {'role': str, 'content': str} messages"
    if not isinstance(messages, (list, tuple)) or not messages:
        raise InvalidParameter("prompt", shape)
    for i, m in enumerate(messages):
        content = m.get("content") if isinstance(m, dict) else None
        ok = isinstance(m, dict) and isinstance(m.get("role"), str) and (
            isinstance(content, (str, list)) or (content is None and m.get("tool_calls")))
        if not ok:
            raise InvalidParameter("prompt", f"{shape}; message {i} is {m!r}"[:300])
        if isinstance(content, str):
            _check_text(content, f"prompt[{i}].content")


class TextTracker:
    """Turns a sequence's generated ids into new text pieces, honouring stop strings: text
    that might be the start of a stop string is held back until it is decided. Decoding is
    incremental (each token is decoded once), so a long answer costs linear time."""

    def __init__(self, tokenizer, stop: tuple[str, ...], prompt_len: int = 0,
                 fault_hook: FaultHook | None = None):
        self.stop = stop
        self.fault_hook = fault_hook  # its "detokenize" point (Engine.fault_hook)
        self.decoder = tokenizer.incremental_decoder() if tokenizer is not None else None
        self.text = ""      # complete characters decoded so far
        self.consumed = 0   # generated tokens fed to the decoder
        self.emitted = 0    # characters already yielded
        self.searched = 0   # stop strings were looked for in text[:searched]
        self.hold = max((len(s) for s in stop), default=1) - 1
        self.ends: list[float] = []  # len(text) once each consumed token's text was out (inf: not yet)
        self.done = False   # the sequence had finished at the last update
        self.stopped = False  # a stop string ended the text: nothing more is emitted

    @property
    def shown(self) -> int | None:
        """Generated tokens whose text has been yielded (those a stream's chunk may carry with
        it: text a stop string may still end is held back, and so are its tokens; so is a token
        holding the first bytes of a character); None: all."""
        return None if self.done or self.decoder is None else bisect.bisect_right(self.ends, self.emitted)

    def update(self, seq: Sequence) -> str:
        if self.fault_hook is not None:
            self.fault_hook("detokenize", seq)
        self.done = seq.finished
        if self.decoder is None or self.stopped:
            return ""
        new = seq.generated[self.consumed:]
        if not self.stop:
            self._push(new, seq.finished)
            return self._emit(len(self.text) if seq.finished else len(self.text) - self.hold)
        # one token at a time, as AR steps commit them: the output ends with the token that
        # completes a stop string, also where a cycle committed tokens past it
        for i, token in enumerate(new):
            self._push([token], seq.finished and i == len(new) - 1)
            if (cut := self._stop(seq)) is not None:
                return self._emit(cut)
        if seq.finished and not new:
            self._push([], True)  # the end (EOS) completes nothing: what the decoder held
            if (cut := self._stop(seq)) is not None:
                return self._emit(cut)
        return self._emit(len(self.text) if seq.finished else len(self.text) - self.hold)

    def _push(self, tokens: list[int], last: bool) -> None:
        """Decode ``tokens`` (``last``: and flush), recording where each one's text ends."""
        self.consumed += len(tokens)
        self.text += self.decoder.push(tokens)
        if last:
            self.text += self.decoder.flush()
        waiting = self.decoder.pending and not last
        self.ends += [math.inf if waiting else len(self.text)] * len(tokens)
        if not waiting:  # earlier tokens of a character now complete
            for j in range(len(self.ends) - 1, -1, -1):
                if self.ends[j] != math.inf:
                    break
                self.ends[j] = len(self.text)

    def _stop(self, seq: Sequence) -> int | None:
        """Where the text ends if a stop string now stands in it (the sequence then ends at the
        token that completed it: ``Sequence.stop_after``), else None."""
        cut = self._stop_at()
        if cut < 0:
            return None
        seq.stop_after(self.consumed)
        self.done = self.stopped = True
        return cut

    def _stop_at(self) -> int:
        """Where the first stop string starts in the text, or -1 (each part searched once)."""
        start = max(0, self.searched - self.hold)
        self.searched = len(self.text)
        return min((i for i in (self.text.find(s, start) for s in self.stop) if i >= 0), default=-1)

    def _emit(self, end: int) -> str:
        end = max(self.emitted, end)
        piece, self.emitted = self.text[self.emitted:end], end
        return piece
