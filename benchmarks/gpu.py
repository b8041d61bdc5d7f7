"""GPU benchmark (issue 7): one device call builds its models, checks them against the
reference path, times them, prints a table and writes JSON.

    PYTHONPATH=. python benchmarks/gpu.py --out results.json [--shapes smollm2,qwen3-1.7b,qwen3-8b]
        [--default-gguf PATH] [--hf-baseline eager,compile] [--quant int4,int8,fp8 [--quant-group 32] [--no-quant-sweep]]

Random-weight models with real shapes, each with a random MTP head:
- AR tok/s at batch 1 and its share of the roofline (bytes read per token over the
  device-to-device copy bandwidth measured in the same run);
- verify-step time for 1 + D tokens over the AR-step time (D = 1, 2, 3); draft-step time over AR;
- AR aggregate tok/s at 1/2/4/8 concurrent streams;
- transformers' generate on the same shapes (eager, and static cache + torch.compile) as baseline.
The real default model (with its forged head, if present): AR and MTP tok/s per depth and
acceptance by depth.
With ``--quant``, each shape instead runs bf16 against the listed weight formats (quantized on
the device from the same random bf16 weights; issue 17): every quantized layer checked against
its dequantized weight's matmul, the logits against the PyTorch reference path, the prefill
graphs against eager forwards; then AR step time, verify 1 + D over AR, AR tok/s at batch 1 and
its ratio to bf16; and a sweep of the quantized GEMV's block sizes on the shape's matrices.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch

from mtplx.engine.generator import stack_padded
from mtplx.engine.llm_engine import Engine
from mtplx.engine.sampling import SamplingParams
from mtplx.engine.sequence import Sequence
from mtplx.loading.checkpoint import LoadedModel
from mtplx.loading.weights import attach_head, build_model_on_meta
from mtplx.loading.mtp_weights import HeadWeights
from mtplx.models.config import MTPConfig, ModelConfig
from mtplx.models.mtp import MTPHead

SHAPES = {
    "smollm2-135m": dict(model_type="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536,
                         num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, head_dim=64,
                         tie_word_embeddings=True, rope_theta=100000.0, max_position_embeddings=8192),
    "qwen3-1.7b": dict(model_type="qwen3", vocab_size=151936, hidden_size=2048, intermediate_size=6144,
                       num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                       tie_word_embeddings=True, rope_theta=1000000.0, max_position_embeddings=40960),
    "qwen3-8b": dict(model_type="qwen3", vocab_size=151936, hidden_size=4096, intermediate_size=12288,
                     num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                     tie_word_embeddings=False, rope_theta=1000000.0, max_position_embeddings=40960),
}
PROMPT_LEN, NEW_TOKENS = 16, 256


def copy_bandwidth(device) -> float:
    """Device-to-device copy, bytes read + written per second (median of 10)."""
    n = 1 << 30  # 1 GiB of bf16 elements = 2 GiB
    a = torch.empty(n, dtype=torch.bfloat16, device=device).normal_()
    b = torch.empty_like(a)
    times = []
    for _ in range(13):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record(); b.copy_(a); e.record(); torch.cuda.synchronize()
        times.append(s.elapsed_time(e) / 1e3)
    del a, b
    return 2 * n * 2 / sorted(times[3:])[len(times[3:]) // 2]


def random_engine(shape: dict, device, dtype=torch.bfloat16, quant: str | None = None, group: int = 32) -> Engine:
    """Random weights with the shape's config and a random MTP head; ``quant``: the trunk's
    linear weights quantized on the device to that format (the head stays in ``dtype``)."""
    config = ModelConfig.from_hf(shape)
    model = build_model_on_meta(config).to_empty(device=device).to(dtype)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.fill_(1.0) if "norm" in name else p.normal_(0, 0.02)
    from mtplx.models.layers import rope_inv_freq
    model.rotary.inv_freq = rope_inv_freq(config).to(device)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    model.requires_grad_(False).eval()
    if quant is not None:
        from mtplx.models.quant import quantize_linears

        quantize_linears(model, quant, group)
        torch.cuda.empty_cache()
    with torch.device("meta"):
        shapes = MTPHead(model, MTPConfig(layout="sidecar")).state_dict()
    state = {k: (torch.ones(v.shape) if "norm" in k else torch.randn(v.shape) * 0.02) for k, v in shapes.items()}
    head = attach_head(model, HeadWeights(state, MTPConfig(layout="sidecar")), device, dtype)
    t0 = time.perf_counter()
    engine = Engine(LoadedModel(model, head, None, config, source=None), kv_cache_tokens=16384)
    engine.build_s = time.perf_counter() - t0  # CUDA graphs are captured here
    return engine


def weight_bytes(engine: Engine) -> int:
    from mtplx.models.quant import QuantLinear

    model = engine.loaded.model
    seen, total = set(), 0
    total += sum(m.weight_bytes() for m in model.modules() if isinstance(m, QuantLinear))
    for name, p in model.named_parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        if name == "model.embed_tokens.weight" and not model.config.tie_word_embeddings:
            continue  # an untied embedding is read one row per token
        total += p.numel() * p.element_size()
    return total


def timed(fn, repeats=20, warmup=3) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record(); fn(); e.record(); torch.cuda.synchronize()
        times.append(s.elapsed_time(e) / 1e3)
    return sorted(times)[len(times) // 2]


def step_costs(engine: Engine, context: int = 128) -> dict:
    """Median time of one trunk forward of q tokens (q = 1 AR, 1+D verify) and of one head step."""
    runner = engine.runner
    seq = Sequence(prompt_ids=list(range(1, context + 1)), params=SamplingParams(), max_tokens=1)
    runner.blocks.allocate(seq.seq_id, seq.prompt_ids)
    runner.blocks.ensure_capacity(seq.seq_id, context + 8)  # the steps, verifies and drafts timed below
    with torch.inference_mode():
        runner.trunk([seq], [seq.prompt_ids], [0])
        out = {}
        ar = timed(lambda: runner.logits(runner.trunk([seq], [[5]], [context])[:, -1]))
        out["ar_step_s"] = ar
        out["trunk_forward_only_s"] = timed(lambda: runner.trunk([seq], [[5]], [context]))
        with runner.eager():
            out["trunk_forward_eager_s"] = timed(lambda: runner.trunk([seq], [[5]], [context]))
        out["runner"] = "cuda_graphs" if runner.graphs is not None else "eager"
        for d in (1, 2, 3):
            t = timed(lambda: runner.logits(runner.trunk([seq], [[5] * (d + 1)], [context])))
            out[f"verify_1+{d}_over_ar"] = t / ar
        hidden = torch.zeros(1, 1, engine.config.hidden_size, dtype=engine.dtype, device=engine.device)
        draft = timed(lambda: runner.logits(runner.head_forward([seq], hidden, [[5]], [context])[:, -1]).argmax(-1))
        out["draft_step_over_ar"] = draft / ar  # one head step, its logits and argmax, each launched alone
        # the greedy MTP cycle as decoding runs it (one graph: catch-up, drafts, verify, acceptance);
        # one more depth adds a head step + logits + argmax and one verified token
        seq.tokens = seq.prompt_ids + [5] * 8
        seq.trunk_len = seq.head_len = context
        cycle = {}
        for d in (1, 2, 3):
            seq.depth = d
            cycle[d] = timed(lambda: runner.greedy_cycle([seq], hidden, d))
            out[f"cycle_d{d}_over_ar"] = cycle[d] / ar
        verify_growth = out["verify_1+3_over_ar"] - out["verify_1+1_over_ar"]
        out["draft_step_in_cycle_over_ar"] = ((cycle[3] - cycle[1]) / ar - verify_growth) / 2
    runner.blocks.free(seq.seq_id)
    return out


def ar_tok_s(engine: Engine, streams: int) -> float:
    """Aggregate AR decode tok/s with ``streams`` concurrent greedy rows (after prefill)."""
    gen = engine.generator
    seqs = []
    for i in range(streams):
        req = engine.make_request(list(range(3 + i, 3 + i + PROMPT_LEN)), mode="ar", max_tokens=NEW_TOKENS,
                                  ignore_eos=True)
        seq = engine.new_sequence(req)
        gen.admit(seq)
        gen.prefill(seq)
        seqs.append(seq)
    with torch.inference_mode():
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        while not all(s.finished for s in seqs):
            engine.step([s for s in seqs if not s.finished])
        torch.cuda.synchronize()
        elapsed = time.perf_counter() - t0
    tokens = sum(s.num_generated - 1 for s in seqs)
    for s in seqs:
        gen.release(s)
    return tokens / elapsed


def float32_copy(engine: Engine) -> Engine:
    """The same weights in float32 on the same device, run eagerly (the precise reference)."""
    config = engine.config
    model = build_model_on_meta(config).to_empty(device=engine.device).float()
    model.load_state_dict({k: v.float() for k, v in engine.loaded.model.state_dict().items()})
    from mtplx.models.layers import rope_inv_freq
    model.rotary.inv_freq = rope_inv_freq(config).to(engine.device)
    model.requires_grad_(False).eval()
    head = None
    if engine.loaded.head is not None:
        mtp = engine.loaded.head
        head = attach_head(model, HeadWeights(mtp.state_dict(), mtp.mtp), engine.device, torch.float32)
    return Engine(LoadedModel(model, head, None, config, source=None), kv_cache_tokens=4096, cuda_graphs=False)


def check_against_reference(engine: Engine) -> dict:
    """Fail loudly unless the fast path (CUDA graphs, fused Triton kernels, Triton attention)
    is as close to the float32 reference as the bf16 PyTorch reference path is: logits of
    prefill, AR, verify and draft forwards on fresh random tokens. (benchmarks/check_kernels.py
    also checks the attention kernel alone against the reference in float64.)"""
    from mtplx import kernels

    engines = {"fast": engine, "reference_bf16": Engine(engine.loaded, kv_cache_tokens=4096, cuda_graphs=False),
               "reference_fp32": float32_copy(engine)}
    g = torch.Generator().manual_seed(int(time.time()))
    vocab = engine.config.vocab_size
    prompt = torch.randint(0, vocab, (40,), generator=g).tolist()
    h_in = torch.randn(1, 1, engine.config.hidden_size, generator=g)
    logits = {}
    with torch.inference_mode():
        for name, eng in engines.items():
            kernels.ENABLED = name == "fast"
            seq = Sequence(prompt_ids=prompt, params=SamplingParams(), max_tokens=1)
            eng.runner.blocks.allocate(seq.seq_id, prompt)
            eng.runner.blocks.ensure_capacity(seq.seq_id, 48)  # the verifies and the head step below
            outs = [eng.runner.logits(eng.runner.trunk([seq], [prompt], [0])).float()]
            rows = [[prompt[-1]], prompt[-4:], prompt[-2:]]
            outs += [eng.runner.logits(eng.runner.trunk([seq], [r], [40])).float() for r in rows]
            h = h_in.to(eng.device, eng.dtype)
            outs.append(eng.runner.logits(eng.runner.head_forward([seq], h, [[prompt[3]]], [41])).float())
            eng.runner.blocks.free(seq.seq_id)
            logits[name] = outs
        kernels.ENABLED = True
    rel = lambda a, b: float((a - b).norm() / b.norm())  # noqa: E731
    fast = [rel(a, b) for a, b in zip(logits["fast"], logits["reference_fp32"])]
    ref = [rel(a, b) for a, b in zip(logits["reference_bf16"], logits["reference_fp32"])]
    print(f"  vs float32 reference (prefill, AR, verify 1+3, verify 1+1, draft): fast path "
          f"{[round(e, 4) for e in fast]}, bf16 reference path {[round(e, 4) for e in ref]}", flush=True)
    if any(f > 1.25 * r + 2e-3 for f, r in zip(fast, ref)) or any(torch.isnan(a).any() for a in logits["fast"]):
        raise SystemExit(f"FAIL: the fast path is further from the float32 reference than the bf16 reference "
                         f"path is: {fast} vs {ref}")
    del engines, logits
    torch.cuda.empty_cache()
    return {"fast_vs_fp32_rel_err": fast, "reference_bf16_vs_fp32_rel_err": ref}


def check_cycle_graph(engine: Engine, report_only: bool = False) -> dict:
    """Fail loudly unless the whole-cycle CUDA graph (greedy MTP) computes what the eager
    ``ModelRunner.greedy_cycle`` computes from the same state: 1 and 3 rows, depths 1-3, after a
    real first cycle (so the catch-up is a cycle's, not a prompt's). Drafts may differ only
    where bf16 rounding flips a near-tie (counted, and bounded): the graph pads rows to their
    bucket, and cuBLAS rounds 3 rows and 4 differently. A flipped draft changes the verify's
    input, so the verify outputs are compared only where every draft agreed."""
    gen, runner = engine.generator, engine.runner
    gen.chain.enabled = False  # each cycle from the host's state, to compare with the eager one
    worst, flips, drafted = 0.0, 0, 0
    g = torch.Generator().manual_seed(int(time.time()))
    for rows in (1, 3):
        for depth in (1, 2, 3):
            seqs = []
            for _ in range(rows):
                prompt = torch.randint(0, engine.config.vocab_size, (24,), generator=g).tolist()
                seq = engine.new_sequence(engine.make_request(prompt, mode="mtp", depth=depth, max_tokens=64,
                                                              ignore_eos=True))
                gen.admit(seq)
                gen.prefill(seq)
                seqs.append(seq)
            with torch.inference_mode():
                engine.step(seqs)  # eager (a prompt-wide catch-up); leaves a cycle-sized backlog
                backlog = stack_padded([s.hidden_backlog for s in seqs])
                for s in seqs:  # the blocks the cycle writes (the generator reserves them before a cycle)
                    engine.kv.reserve(s, s.trunk_len + depth + 1)
                fast = [t.clone() for t in runner.greedy_cycle(seqs, backlog, depth)]
                with runner.eager():
                    ref = runner.greedy_cycle(seqs, backlog, depth)
            same = (fast[2][:, :depth] == ref[2][:, :depth]).all(dim=1)
            errs = [float((a[same].float() - b[same].float()).norm() / b[same].float().norm()) if same.any()
                    else 0.0 for a, b in zip(fast[:2], ref[:2])]
            worst = max(worst, *errs)
            flips += int((fast[2][:, :depth] != ref[2][:, :depth]).sum())
            print(f"    rows {rows} depth {depth}: hidden {errs[0]:.4f} logits {errs[1]:.4f} packed "
                  f"{fast[2].tolist()} vs {ref[2].tolist()}", flush=True)
            drafted += rows * depth
            for s in seqs:
                gen.release(s)
    gen.chain.enabled = True
    print(f"  whole-cycle graph vs eager cycle: worst relative error where drafts agree {worst:.4f}, drafts differing "
          f"{flips}/{drafted}", flush=True)
    if (worst > 0.05 or flips > drafted // 4) and not report_only:
        raise SystemExit(f"FAIL: the whole-cycle CUDA graph differs from the eager cycle: {worst}, {flips}")
    return {"cycle_graph_vs_eager_rel_err": worst, "cycle_graph_draft_flips": [flips, drafted]}


def decode_rows(engine: Engine, prompts: list[list[int]], depth: int, max_tokens: int,
                apart: bool = True) -> list[list[int]]:
    """Greedy decoding of rows in one batch (AR at depth 0, else MTP), row i to max_tokens - 11 i
    (rows end apart), or every row to max_tokens."""
    from mtplx.forge.data import decode_rows as decode_batch

    mode = dict(mode="mtp", depth=depth) if depth else dict(mode="ar")
    requests = [(i, engine.make_request(p, **mode, max_tokens=max_tokens - 11 * i * apart, ignore_eos=True))
                for i, p in enumerate(prompts)]
    done = dict(decode_batch(engine, iter(requests), len(requests)))
    return [done[i].generated for i in range(len(prompts))]


def check_chain(engine: Engine, report_only: bool = False) -> dict:
    """Fail loudly unless chained cycles (each cycle's inputs written by the last one's graph,
    the host one cycle behind) decode exactly the tokens of cycles started from the host's
    state: the same graph on the same integers. 1 and 3 rows, AR and MTP depths 1-3, random
    prompts shorter than a block (no prefix-cache hit between the two runs).
    One exception, reported and not failed: unchained AR over several rows computes its logits
    eagerly over those rows, the chained graph over the rows bucket (3 rows vs 4 in cuBLAS's
    lm_head GEMM round differently), so a near-tie may flip there."""
    chain = engine.generator.chain
    g = torch.Generator().manual_seed(int(time.time()) + 1)
    differing, repeat = {}, {}
    for rows in (1, 3):
        for depth in (0, 1, 2, 3):
            prompts = [torch.randint(0, engine.config.vocab_size, (12,), generator=g).tolist() for _ in range(rows)]
            out = {}
            for chained in (False, True):
                chain.enabled = chained
                out[chained] = decode_rows(engine, prompts, depth, 64)
            differing[f"rows{rows}_depth{depth}"] = sum(a != b for a, b in zip(out[False], out[True]))
            if rows > 1:  # the unchained path twice: how far run-to-run nondeterminism alone goes
                chain.enabled = False
                again = decode_rows(engine, prompts, depth, 64)
                repeat[f"rows{rows}_depth{depth}"] = sum(a != b for a, b in zip(out[False], again))
                together = {}  # rows ending together: no chain restart over fewer rows
                for chained in (False, True):
                    chain.enabled = chained
                    together[chained] = decode_rows(engine, prompts, depth, 64, apart=False)
                repeat[f"rows{rows}_depth{depth}_ending_together_chained_vs_not"] = sum(
                    a != b for a, b in zip(together[False], together[True]))
    chain.enabled = True
    failing = {k: v for k, v in differing.items() if v and not (k.endswith("depth0") and not k.startswith("rows1"))}
    print(f"  chained vs unchained decoding, rows differing per case: {differing}", flush=True)
    print(f"  unchained vs unchained (same prompts, run again): {repeat}", flush=True)
    if failing and not report_only:
        raise SystemExit(f"FAIL: chained cycles decode differently from unchained ones: {failing}")
    return {"chained_rows_differing": differing, "unchained_repeat_rows_differing": repeat}


def check_prefill_graphs(engine: Engine) -> dict:
    """Fail loudly unless forwards fed through the prefill graphs (each row alone, in chunks of
    up to 256 tokens, each padded to its bucket) give the hidden states of the eager forward:
    one row from scratch and after a cached prefix, 5 tokens after a prefix (no decode graph
    of that length), and three rows of different lengths; the trunk and the head's pre-feed.
    Relative error per case. The two differ only in GEMM shapes, so by bf16 rounding, which
    on a random-weight model grows through the layers to the size of bf16's own error (about
    0.045 against float32 at the 8B shape); a wrong position or table gives errors near 1."""
    runner = engine.runner
    if runner.graphs is None:
        return {}
    g = torch.Generator().manual_seed(11)
    H = engine.config.hidden_size
    cases = [((n,), start) for n in (9, 40, 256, 300, 1000) for start in (0, 100)]
    cases += [((5,), 100), ((20, 300, 9), 0), ((20, 300, 9), 100)]
    errors = {}
    with torch.inference_mode():
        for kind in ("trunk", "head") if runner.head is not None else ("trunk",):
            for lengths, start in cases:
                start += kind == "head"  # the head's pairs start at sequence index 1
                seqs, rows = [], []
                for n in lengths:
                    ids = torch.randint(10, engine.config.vocab_size, (start + n,), generator=g).tolist()
                    seq = Sequence(prompt_ids=ids, params=SamplingParams(), max_tokens=1)
                    runner.blocks.allocate(seq.seq_id, ids)
                    seqs.append(seq)
                    rows.append(ids)
                hidden = torch.randn(len(rows), start + max(lengths), H, generator=g).to(engine.device, engine.dtype)

                def forward(fn, part):
                    if kind == "trunk":
                        return fn(seqs, [r[part] for r in rows], [part.start or 0] * len(rows))
                    h = hidden[:, part]
                    return fn(seqs, h[:, : max(len(r[part]) for r in rows)], [r[part] for r in rows],
                              [part.start or 0] * len(rows))

                def eager_fn(*args, _fn=runner.trunk if kind == "trunk" else runner.head_forward):
                    with runner.eager():
                        return _fn(*args)

                graph_fn = runner.trunk if kind == "trunk" else runner.head_forward
                if start:
                    forward(eager_fn, slice(0, start))
                eager = forward(eager_fn, slice(start, None)).float()
                graphs = forward(graph_fn, slice(start, None)).float()
                for seq in seqs:
                    runner.blocks.free(seq.seq_id)
                valid = torch.arange(eager.shape[1])[None] < torch.tensor(lengths)[:, None]
                valid = valid.to(eager.device)
                errors[f"{kind}_len{'+'.join(map(str, lengths))}_from{start}"] = float(
                    (graphs - eager)[valid].norm() / eager[valid].norm())
    rounded = {k: round(v, 4) for k, v in errors.items()}
    print(f"  prefill graphs vs eager prefill, relative error: {json.dumps(rounded)}", flush=True)
    bad = {k: v for k, v in errors.items() if not v < 0.1}
    if bad:
        raise SystemExit(f"FAIL: prefill through graphs differs from the eager prefill: {bad}")
    return {"prefill_graph_vs_eager_rel_err": errors}


def prefill_variants(engine: Engine, max_tokens: int = 128) -> dict:
    """The bench prompts decoded greedily (AR, depths 1 and 3) with the prompt prefilled three
    ways: through the prefill graphs; eagerly with the attention kernel; eagerly with the
    reference attention for prompts (SDPA, as before session 5). Acceptance per variant, and
    how many AR outputs equal the graphs variant's (they differ only by prefill rounding); for
    graphs and the reference, also forge's held-out acceptance (24 other prompts) at depths 1, 3."""
    from mtplx.benchmarking import BENCH_PROMPTS, configs_for, run_once, summarize
    from mtplx.engine import cuda_graphs
    from mtplx.cache.attention import paged_attention_reference
    from mtplx.models import layers

    from mtplx.forge.build import encode_prompts
    from mtplx.forge.measure import acceptance
    from mtplx.forge.prompts import HELD_OUT_PROMPTS

    kernel_attention, saved = layers.paged_attention, cuda_graphs.PREFILL_GRAPH_TOKENS
    held_out = encode_prompts(engine.loaded, list(HELD_OUT_PROMPTS))

    def reference_for_prompts(q, k_pool, v_pool, meta, scale):
        return (paged_attention_reference if q.shape[1] > 8 else kernel_attention)(q, k_pool, v_pool, meta, scale)

    configs = configs_for(engine, (1, 3))
    out, outputs = {}, {}
    try:
        for name in ("graphs", "eager_kernel", "eager_reference"):
            cuda_graphs.PREFILL_GRAPH_TOKENS = saved if name == "graphs" else 0
            layers.paged_attention = reference_for_prompts if name == "eager_reference" else kernel_attention
            runs = {c.label: [run_once(engine, [{"role": "user", "content": p}], c, max_tokens, ignore_eos=True)
                              for p in BENCH_PROMPTS] for c in configs}
            outputs[name] = [r["token_ids"] for r in runs["ar"]]
            entry = {c.label: {**summarize(runs[c.label], c),
                               "identical_to_ar": sum(a["token_ids"] == r["token_ids"]
                                                      for a, r in zip(runs["ar"], runs[c.label]))}
                     for c in configs}
            entry["ar_outputs_equal_to_graphs_variant"] = sum(a == b for a, b in zip(outputs[name], outputs["graphs"]))
            if name != "eager_kernel":  # forge's held-out measure: 24 prompts, greedy, 128 tokens, 8 rows
                for depth in (1, 3):
                    entry[f"held_out_d{depth}"] = acceptance(engine, held_out, depth=depth, rows=8)
            out[name] = entry
            print(f"  prefill {name}: {json.dumps(entry)}", flush=True)
    finally:
        cuda_graphs.PREFILL_GRAPH_TOKENS, layers.paged_attention = saved, kernel_attention
    return out


def hf_baseline(shape: dict, device, modes) -> dict:
    import transformers

    cfg_cls = transformers.Qwen3Config if shape["model_type"] == "qwen3" else transformers.LlamaConfig
    cls = transformers.Qwen3ForCausalLM if shape["model_type"] == "qwen3" else transformers.LlamaForCausalLM
    cfg = cfg_cls(**{k: v for k, v in shape.items() if k != "model_type"})
    with torch.device(device):
        model = cls(cfg).to(torch.bfloat16).eval()
    ids = torch.arange(3, 3 + PROMPT_LEN, device=device)[None]
    out = {}
    for mode in modes:
        kwargs = dict(max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)
        if mode == "compile":
            # transformers' own best configuration: with a static cache, generate compiles the
            # forward itself (its CompileConfig: fullgraph, "reduce-overhead") and marks each
            # CUDA-graph step. Wrapping model.forward in torch.compile by hand, as the first
            # rounds did, fails on transformers 5.17 ("accessing tensor output of CUDAGraphs
            # that has been overwritten").
            model.generation_config.cache_implementation = "static"
        t_first = time.perf_counter()
        model.generate(ids, **kwargs)  # warm-up (compiles)
        warm = time.perf_counter() - t_first
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        model.generate(ids, **kwargs)
        torch.cuda.synchronize()
        out[f"hf_{mode}_tok_s"] = NEW_TOKENS / (time.perf_counter() - t0)
        out[f"hf_{mode}_warmup_s"] = warm
    del model
    torch.cuda.empty_cache()
    return out


def run_clients(engine: Engine, mode: str, requests: list, clients: int,
                depth: int | None = None) -> tuple[float, list]:
    """``clients`` clients in a closed loop over ``requests``: each submits the next request of the
    list to an in-process scheduler in ``mode`` (the server's own scheduler, without HTTP) when its
    last one has finished, so about ``clients`` requests decode at once until the list runs out (a
    serving benchmark's fixed concurrency); returns (seconds from the first submit to the last
    finish, results in order)."""
    import queue

    from mtplx.batching.job import Done, Failed, Job
    from mtplx.batching.scheduler import Scheduler
    from mtplx.batching.state import SchedulerSettings

    scheduler = Scheduler(engine, SchedulerSettings.resolve(mode, depth=depth))
    scheduler.start()
    ended: queue.Queue = queue.Queue()
    results: dict[int, object] = {}
    pending = iter(enumerate(requests))

    def submit() -> None:
        for i, request in pending:
            scheduler.submit(Job(request, lambda event, i=i: ended.put((i, event))
                                 if isinstance(event, (Done, Failed)) else None))
            return

    t0 = time.perf_counter()
    for _ in range(min(clients, len(requests))):
        submit()
    while len(results) < len(requests):
        i, event = ended.get(timeout=600)
        if isinstance(event, Failed):
            raise SystemExit(f"FAIL: {mode} request {i} failed: {event.error!r}")
        results[i] = event.result
        submit()
    elapsed = time.perf_counter() - t0
    scheduler.stop()
    return elapsed, [results[i] for i in range(len(requests))]


def run_jobs(engine: Engine, mode: str, requests: list, depth: int | None = None) -> tuple[float, list]:
    """Every request submitted at once (``run_clients`` with a client per request)."""
    return run_clients(engine, mode, requests, len(requests), depth)


def run_stream(engine: Engine, mode: str, requests: list) -> tuple[float, list]:
    """One client in a loop (``run_clients`` with one client): each request submitted when the one
    before it has finished (what one stream sees, a cohort's gather window included)."""
    return run_clients(engine, mode, requests, 1)


def scheduler_modes(engine: Engine, depth: int, max_tokens: int = 128, batch_only: bool = False) -> dict:
    """hyper vs serial on the same greedy chat requests (tok/s ratio, byte-identical outputs),
    and mtp_batch / ar_batch aggregate tok/s at 1/2/4/8 concurrent streams (only these with
    ``batch_only``)."""
    from mtplx.benchmarking import BENCH_PROMPTS

    def requests(n: int, mode: str | None = None) -> list:
        prompts = [BENCH_PROMPTS[i % len(BENCH_PROMPTS)] for i in range(n)]
        return [engine.make_request([{"role": "user", "content": p}], chat=True, mode=mode, depth=depth,
                                    max_tokens=max_tokens, ignore_eos=True) for p in prompts]

    out = {}
    for mode in ("serial", "hyper"):  # warm-up (each mode's first scheduler)
        run_jobs(engine, mode, requests(1)[:1], depth)
    times = {}
    for mode in () if batch_only else ("serial", "hyper") * 3:  # interleaved, best of three
        elapsed, results = run_jobs(engine, mode, requests(len(BENCH_PROMPTS)), depth)
        tokens = sum(r.completion_tokens for r in results)
        times.setdefault(mode, []).append((tokens / elapsed, results))
    if times:
        serial = max(times["serial"], key=lambda t: t[0])
        hyper = max(times["hyper"], key=lambda t: t[0])
        out["serial_tok_s"], out["hyper_tok_s"] = serial[0], hyper[0]
        out["hyper_over_serial"] = hyper[0] / serial[0]
        out["runs_tok_s"] = {m: [round(t[0], 1) for t in times[m]] for m in times}
        out["runs_ttft_ms"] = {m: [[round(r.stats["ttft_s"] * 1e3, 2) for r in t[1]] for t in times[m]] for m in times}
        out["hyper_byte_identical"] = all(a.text == b.text and a.token_ids == b.token_ids
                                          for a, b in zip(serial[1], hyper[1]))
        # where a request's wall time goes: time to first token, then decoding alone
        for name, (_, results) in (("serial", serial), ("hyper", hyper)):
            out[f"{name}_mean_ttft_s"] = sum(r.stats["ttft_s"] for r in results) / len(results)
            out[f"{name}_mean_decode_tok_s"] = sum(r.stats["decode_tok_s"] for r in results) / len(results)
    for mode, gen_mode in (("mtp_batch", "mtp"), ("ar_batch", "ar")):
        for streams in (1, 2, 4, 8):
            elapsed, results = run_jobs(engine, mode, requests(streams, gen_mode), depth)
            out[f"{mode}_tok_s_x{streams}"] = sum(r.completion_tokens for r in results) / elapsed
            out[f"{mode}_mean_ttft_s_x{streams}"] = sum(r.stats["ttft_s"] for r in results) / len(results)
            out[f"{mode}_mean_decode_tok_s_x{streams}"] = sum(r.stats["decode_tok_s"] for r in results) / len(results)
    return out


def prefill_costs(engine: Engine, lengths=(16, 64, 256, 1024, 4096)) -> dict:
    """Where time to first token goes, per prompt length (random ids, AR, one token): the whole
    request (admit, prefill, logits, first token, release) on the host clock; the trunk's
    prefill forward alone (CUDA events), as the runner runs it and eagerly; the runner's kernel
    launches and GPU kernel time (profiler).
    And one chat request end to end (template, tokenizer, prefill) for comparison."""
    from torch.profiler import ProfilerActivity, profile

    runner, out = engine.runner, {}
    g = torch.Generator().manual_seed(7)
    for n in lengths:
        ids = torch.randint(10, engine.config.vocab_size, (n,), generator=g).tolist()

        def request():
            ids[0] = (ids[0] + 1) % engine.config.vocab_size  # no prefix-cache hit between runs
            t0 = time.perf_counter()
            engine.generate(list(ids), mode="ar", max_tokens=1)
            torch.cuda.synchronize()
            return time.perf_counter() - t0

        request()
        whole = sorted(request() for _ in range(7))[3]
        seq = Sequence(prompt_ids=list(ids), params=SamplingParams(), max_tokens=1)
        runner.blocks.allocate(seq.seq_id, seq.prompt_ids)
        with torch.inference_mode():
            forward = timed(lambda: runner.trunk([seq], [seq.prompt_ids], [0]), repeats=7, warmup=2)
            with runner.eager():
                eager = timed(lambda: runner.trunk([seq], [seq.prompt_ids], [0]), repeats=7, warmup=2)
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                runner.trunk([seq], [seq.prompt_ids], [0])
                torch.cuda.synchronize()
        runner.blocks.free(seq.seq_id)
        events = prof.key_averages()
        kernel_us = sum((getattr(e, "self_device_time_total", 0) or 0) for e in events if e.self_cpu_time_total == 0)
        launches = sum(e.count for e in events if e.key in ("cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx",
                                                            "cudaLaunchKernelExC"))
        out[f"len{n}"] = {"request_ms": whole * 1e3, "prefill_forward_ms": forward * 1e3,
                          "prefill_forward_eager_ms": eager * 1e3,
                          "prefill_gpu_kernel_ms": kernel_us / 1e3, "prefill_kernel_launches": launches}
        print(f"  prefill {n} tokens: {json.dumps({k: round(v, 3) for k, v in out[f'len{n}'].items()})}", flush=True)
    if engine.tokenizer is not None:
        from mtplx.benchmarking import BENCH_PROMPTS

        times = []
        for p in BENCH_PROMPTS:
            t0 = time.perf_counter()
            r = engine.generate([{"role": "user", "content": p}], chat=True, mode="ar", max_tokens=1)
            torch.cuda.synchronize()
            times.append((time.perf_counter() - t0, r.stats["ttft_s"], r.prompt_tokens))
        out["chat_requests"] = [{"request_ms": a * 1e3, "ttft_ms": b * 1e3, "prompt_tokens": c} for a, b, c in times]
        print(f"  chat requests (ms, ttft ms, tokens): {[(round(a*1e3,1), round(b*1e3,1), c) for a, b, c in times]}",
              flush=True)
    return out


def profile_decode(engine, max_tokens: int = 128, **sampling) -> dict:
    """Where one request's decode time goes, per configuration: wall time per cycle against GPU
    kernel time per cycle (the rest is host time the GPU waited for), CUDA-graph launches and
    eager kernel launches per cycle, the busiest host ops (torch.profiler), and the busiest
    Python functions (cProfile, in a separate run: it slows the host)."""
    import cProfile
    import pstats

    from torch.profiler import ProfilerActivity, profile

    from mtplx.benchmarking import BENCH_PROMPTS, configs_for, run_once

    prompt = [{"role": "user", "content": BENCH_PROMPTS[0]}]
    out = {}
    for config in configs_for(engine, (1, 2, 3)):
        run_once(engine, prompt, config, 16, **sampling)
        plain = run_once(engine, prompt, config, max_tokens, ignore_eos=True, **sampling)
        cycles = plain["verify_calls"] or plain["tokens"]
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            run_once(engine, prompt, config, max_tokens, ignore_eos=True, **sampling)
        events = prof.key_averages()

        def device_us(e):
            return getattr(e, "self_device_time_total", None) or getattr(e, "self_cuda_time_total", 0)

        kernels = [e for e in events if device_us(e) > 0 and e.self_cpu_time_total == 0]
        host = sorted(events, key=lambda e: -e.self_cpu_time_total)[:20]
        graph_launches = sum(e.count for e in events if e.key == "cudaGraphLaunch")
        kernel_launches = sum(e.count for e in events if e.key in ("cudaLaunchKernel", "cuLaunchKernel",
                                                                     "cudaLaunchKernelExC"))
        prof_py = cProfile.Profile()
        prof_py.enable()
        run_once(engine, prompt, config, max_tokens, ignore_eos=True, **sampling)
        prof_py.disable()
        stats = pstats.Stats(prof_py)
        py = sorted(stats.stats.items(), key=lambda kv: -kv[1][2])[:25]
        out[config.label] = {
            "tokens": plain["tokens"], "cycles": cycles,
            "wall_ms_per_cycle": plain["decode_s"] * 1e3 / cycles,
            "gpu_kernel_ms_per_cycle": sum(device_us(e) for e in kernels) / 1e3 / cycles,
            "graph_launches_per_cycle": graph_launches / cycles,
            "eager_kernel_launches_per_cycle": kernel_launches / cycles,
            "top_kernels": [[e.key[:80], e.count, round(device_us(e) / cycles, 1)]
                            for e in sorted(kernels, key=lambda e: -device_us(e))[:12]],
            "top_host_ops_us_per_cycle": [[e.key[:80], e.count, round(e.self_cpu_time_total / cycles, 1)]
                                          for e in host],
            "top_python_tottime_us_per_cycle": [[f"{k[0].split('mtplx/')[-1]}:{k[1]}:{k[2]}", v[1],
                                                 round(v[2] * 1e6 / cycles, 1)] for k, v in py],
        }
        print("profile", config.label, json.dumps({k: v for k, v in out[config.label].items()
                                                   if not k.startswith("top")}), flush=True)
    return out


def check_quantized_layers(engine: Engine, rows=(1, 4, 8, 33)) -> dict:
    """Fail loudly unless every quantized layer's kernel product (the GEMV up to 8 rows, the
    dequantizing kernel + cuBLAS above) matches bf16 inputs times the dequantized weight in
    float32: error relative to sum_k |x_k| |w_nk| (the scale of bf16 rounding), worst over layers."""
    from mtplx.models.quant import QuantLinear

    g = torch.Generator(device=engine.device).manual_seed(11)
    worst = {r: [0.0, 0.0] for r in rows}  # [max abs error, max error / sum |x||w|]
    with torch.inference_mode():
        for module in engine.loaded.model.modules():
            if not isinstance(module, QuantLinear):
                continue
            w = module.dequantize()
            for r in rows:
                x = torch.randn(r, module.in_features, generator=g, device=engine.device).bfloat16()
                ref = x.float() @ w.T
                if module.bias is not None:
                    ref += module.bias.float()
                err = (module(x).float() - ref).abs()
                scale = x.float().abs() @ w.abs().T + 1e-6
                worst[r] = [max(worst[r][0], float(err.max())), max(worst[r][1], float((err / scale).max()))]
    print(f"  quantized layers vs dequantized matmul, rows: [max abs error, max relative to sum|x||w|]: {worst}",
          flush=True)
    if any(not rel < 1e-2 for _, rel in worst.values()):
        raise SystemExit(f"FAIL: a quantized kernel differs from the dequantized weight's matmul: {worst}")
    return {"quant_layer_max_err_by_rows": {str(r): v for r, v in worst.items()}}


def check_quantized_logits(engine: Engine) -> dict:
    """Fail loudly unless the fast path (graphs, Triton kernels) gives the PyTorch reference
    path's logits (eager, kernels off: each weight dequantized to bf16 and multiplied by cuBLAS)
    on the same quantized weights: prefill, AR, verify 1+3 and 1+1."""
    from mtplx import kernels

    reference = Engine(engine.loaded, kv_cache_tokens=4096, cuda_graphs=False)
    g = torch.Generator().manual_seed(int(time.time()))
    prompt = torch.randint(0, engine.config.vocab_size, (40,), generator=g).tolist()
    logits = {}
    with torch.inference_mode():
        for name, eng in (("fast", engine), ("reference", reference)):
            kernels.ENABLED = name == "fast"
            seq = Sequence(prompt_ids=prompt, params=SamplingParams(), max_tokens=1)
            eng.runner.blocks.allocate(seq.seq_id, prompt)
            eng.runner.blocks.ensure_capacity(seq.seq_id, 48)
            outs = [eng.runner.logits(eng.runner.trunk([seq], [prompt], [0])).float()]
            outs += [eng.runner.logits(eng.runner.trunk([seq], [r], [40])).float()
                     for r in ([prompt[-1]], prompt[-4:], prompt[-2:])]
            eng.runner.blocks.free(seq.seq_id)
            logits[name] = outs
        kernels.ENABLED = True
    errs = [float((a - b).norm() / b.norm()) for a, b in zip(logits["fast"], logits["reference"])]
    print(f"  quantized fast path vs reference path logits (prefill, AR, verify 1+3, 1+1): "
          f"{[round(e, 4) for e in errs]}", flush=True)
    if not all(e < 0.1 for e in errs):  # bf16 roundings in another order: a few percent on the 8B shape
        raise SystemExit(f"FAIL: the quantized fast path differs from the reference path: {errs}")
    del reference
    torch.cuda.empty_cache()
    return {"quant_fast_vs_reference_rel_err": errs}


def quant_gemv_sweep(config: ModelConfig, device, fmt: str, group: int) -> dict:
    """The format's default quantized GEMV (int4: the tensor-core one, timed alone; the others:
    the CUDA-core one against bf16 cuBLAS) in its default configuration on the shape's matrices
    (fused qkv, o, fused gate/up, down, LM head) at 1 and 4 rows, each timed in a CUDA graph over
    rotated copies of the weight (benchmarks/quant_gemv.py; it sweeps the configurations too)."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    from quant_gemv import bench_matrix, bench_mma

    h, kv = config.hidden_size, config.num_key_value_heads * config.head_dim
    mats = {"qkv": (config.num_attention_heads * config.head_dim + 2 * kv, h),
            "o": (h, config.num_attention_heads * config.head_dim),
            "gate_up": (2 * config.intermediate_size, h), "down": (h, config.intermediate_size),
            "lm_head": (config.vocab_size, h)}
    bench = bench_mma if fmt == "int4" else bench_matrix  # each format's default kernel (models/quant.py)
    return {name: bench(name, n, k, fmt, (1, 4), True, device, group) for name, (n, k) in mats.items()}


def quant_comparison(shape: dict, device, fmts: list[str], group: int, bandwidth: float, sweep: bool = True) -> dict:
    """bf16 against each quantized format on one shape (see the module docstring); the issue's
    H200 targets: int4 AR >= 2.5x bf16, int8 >= 1.6x, int4 verify 1+3 <= 1.2x an AR step."""
    out = {}
    for label in ("bf16", *fmts):
        # "int4/cuda-cores", "int8/mma": the format on the other CUDA kernel than its default
        # (MTPLX_CUDA_QUANT; kernels/quant_gemv.py's CUDA-core GEMV, kernels/quant_mma.py's tensor-core one)
        fmt, _, kernel = label.partition("/")
        saved = os.environ.get("MTPLX_CUDA_QUANT")
        if kernel:
            os.environ["MTPLX_CUDA_QUANT"] = kernel
        try:
            engine = random_engine(shape, device, quant=None if fmt == "bf16" else fmt, group=group)
        finally:
            os.environ.pop("MTPLX_CUDA_QUANT", None)
            if saved is not None:
                os.environ["MTPLX_CUDA_QUANT"] = saved
        entry = {"weight_GB": weight_bytes(engine) / 1e9, "engine_build_s": engine.build_s}
        if fmt != "bf16":
            entry.update(check_quantized_layers(engine))
            entry.update(check_quantized_logits(engine))
            entry["quant_prefill_graphs"] = check_prefill_graphs(engine)
        entry.update(step_costs(engine))
        entry["ar_tok_s_x1"] = ar_tok_s(engine, 1)
        entry["roofline_tok_s"] = bandwidth / weight_bytes(engine)
        entry["ar_share_of_roofline"] = entry["ar_tok_s_x1"] / entry["roofline_tok_s"]
        config = engine.config
        del engine
        torch.cuda.empty_cache()
        if fmt != "bf16":
            entry["ar_over_bf16"] = entry["ar_tok_s_x1"] / out["bf16"]["ar_tok_s_x1"]
            entry["ar_step_over_bf16"] = entry["ar_step_s"] / out["bf16"]["ar_step_s"]
            if not kernel and sweep:  # (benchmarks/quant_gemv.py compares the kernels matrix by matrix)
                entry["gemv_sweep"] = quant_gemv_sweep(config, device, fmt, group)
        out[label] = entry
        print(f"  {label}: AR {entry['ar_tok_s_x1']:.1f} tok/s"
              + (f" ({entry['ar_over_bf16']:.2f}x bf16)" if fmt != "bf16" else "")
              + f", verify 1+3 {entry['verify_1+3_over_ar']:.3f}x its AR step, "
              f"{entry['ar_share_of_roofline']:.1%} of its roofline", flush=True)
    targets = {"int4": 2.5, "int8": 1.6}
    out["targets"] = {f"{f}_ar_over_bf16>={t}": out[f]["ar_over_bf16"] >= t for f, t in targets.items() if f in out}
    if "int4" in out:
        out["targets"]["int4_verify_1+3_over_ar<=1.2"] = out["int4"]["verify_1+3_over_ar"] <= 1.2
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--hf-baseline", default="eager")
    ap.add_argument("--default-gguf", default=None)
    ap.add_argument("--cycle-check-report-only", action="store_true",
                    help="print the whole-cycle graph check's errors without failing (diagnosis)")
    ap.add_argument("--head", default=None, help="MTP head directory for the default model")
    ap.add_argument("--profile", action="store_true",
                    help="also profile the default model's decode per configuration (host vs GPU time)")
    ap.add_argument("--quant", default="",
                    help="int4,int8,fp8: per shape, bf16 against these weight formats instead of the full battery")
    ap.add_argument("--quant-group", type=int, default=32, help="inputs per int4/int8 scale for --quant")
    ap.add_argument("--no-quant-sweep", action="store_true", help="--quant without the GEMV configuration sweep")
    args = ap.parse_args()
    device = torch.device("cuda")
    report = {"date": time.strftime("%Y-%m-%d %H:%M"), "gpu": torch.cuda.get_device_name(0),
              "torch": torch.__version__, "copy_bandwidth_GBs": copy_bandwidth(device) / 1e9, "models": {}}
    bw = report["copy_bandwidth_GBs"] * 1e9
    print(f"copy bandwidth {bw / 1e9:.0f} GB/s", flush=True)
    quant = [f for f in args.quant.split(",") if f]
    for name in [n for n in args.shapes.split(",") if n]:
        if quant:
            report["models"][name] = {"quant": quant_comparison(SHAPES[name], device, quant, args.quant_group, bw,
                                                                sweep=not args.no_quant_sweep),
                                      "quant_group": args.quant_group}
            print(name, json.dumps(report["models"][name]["quant"]["targets"]), flush=True)
            continue
        engine = random_engine(SHAPES[name], device)
        entry = {"weight_GB": weight_bytes(engine) / 1e9, **check_against_reference(engine),
                 **check_cycle_graph(engine, report_only=args.cycle_check_report_only),
                 **check_chain(engine, report_only=args.cycle_check_report_only),
                 **check_prefill_graphs(engine)}
        entry.update(step_costs(engine))
        entry["graphs_captured"] = len(engine.runner.graphs.graphs) if engine.runner.graphs is not None else 0
        entry["engine_build_s"] = engine.build_s
        for streams in (1, 2, 4, 8):
            entry[f"ar_tok_s_x{streams}"] = ar_tok_s(engine, streams)
        engine.generator.chain.enabled = False  # each step started from the host's state, for comparison
        entry["ar_tok_s_x1_unchained"] = ar_tok_s(engine, 1)
        engine.generator.chain.enabled = True
        entry["roofline_tok_s"] = bw / weight_bytes(engine)
        entry["ar_share_of_roofline"] = entry["ar_tok_s_x1"] / entry["roofline_tok_s"]
        del engine
        torch.cuda.empty_cache()
        modes = [m for m in args.hf_baseline.split(",") if m]
        entry.update(hf_baseline(SHAPES[name], device, modes))
        report["models"][name] = entry
        print(name, json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in entry.items()}), flush=True)
    if args.default_gguf:
        import mtplx
        from mtplx.benchmarking import measure, render_table

        engine = mtplx.load(args.default_gguf, device="cuda", dtype="bfloat16", head=args.head)
        report["default_model_checks"] = check_prefill_graphs(engine)
        report["default_model"] = measure(engine, max_tokens=128, repeats=2)
        print(render_table(report["default_model"]), flush=True)
        engine.generator.chain.enabled = False  # the same, each cycle started from the host's state
        report["default_model"]["unchained"] = measure(engine, max_tokens=128, repeats=2)
        engine.generator.chain.enabled = True
        print("unchained cycles:\n" + render_table(report["default_model"]["unchained"]), flush=True)
        configs = report["default_model"]["configs"]
        best = max((c for c in configs if c != "ar"), key=lambda c: configs[c]["tok_s"])
        depth = configs[best].get("depth") or 2
        report["default_model"]["prefill"] = prefill_costs(engine)
        report["default_model"]["prefill_variants"] = prefill_variants(engine)
        report["default_model"]["scheduler_modes"] = scheduler_modes(engine, depth)
        print(json.dumps(report["default_model"]["scheduler_modes"]), flush=True)
        engine.generator.chain.enabled = False  # the batch modes again, unchained, for comparison
        report["default_model"]["scheduler_modes_unchained"] = scheduler_modes(engine, depth, batch_only=True)
        engine.generator.chain.enabled = True
        print("unchained:", json.dumps(report["default_model"]["scheduler_modes_unchained"]), flush=True)
        # sampled decoding (chained on the device): AR and MTP at temperature 0.7, top-p 0.95
        sampled = dict(temperature=0.7, top_p=0.95, seed=1234)
        report["default_model"]["sampled"] = measure(engine, max_tokens=128, repeats=2, **sampled)
        print("temperature 0.7, top-p 0.95:\n" + render_table(report["default_model"]["sampled"]), flush=True)
        engine.generator.chain.enabled = False  # sampled cycles each from the host's state, for comparison
        report["default_model"]["sampled_unchained"] = measure(engine, max_tokens=128, repeats=2, **sampled)
        engine.generator.chain.enabled = True
        print("unchained, temperature 0.7, top-p 0.95:\n" + render_table(report["default_model"]["sampled_unchained"]),
              flush=True)
        hot = dict(temperature=1.0, seed=1234)  # the server's default temperature
        report["default_model"]["sampled_t1"] = measure(engine, max_tokens=128, repeats=2, **hot)
        print("temperature 1.0:\n" + render_table(report["default_model"]["sampled_t1"]), flush=True)
        for name, regime in (("mirror", sampled), ("mirror_t1", hot)):  # drafts sampled from the head
            report["default_model"][name] = measure(engine, max_tokens=128, repeats=2, draft_policies=("mirror",), **regime)
            print(f"mirror drafts, {regime}:\n" + render_table(report["default_model"][name]), flush=True)
        if args.profile:
            report["default_model"]["profile"] = profile_decode(engine)
            report["default_model"]["profile_sampled"] = profile_decode(engine, **sampled)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
