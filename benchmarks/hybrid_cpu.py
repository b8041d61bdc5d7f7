"""Hybrid (Qwen3.5-style) decoding on the CPU at a small shape, random weights, float32.

Measures, for one sequence:
  - AR decode tok/s (engine.generate, mode="ar");
  - the cost of a verify step over 1 + D tokens relative to an AR step, D = 1..3, with its
    recurrent-state commit at a partial acceptance (one token kept) and at full acceptance;
  - the two ways to cut the recurrent state back to an accepted prefix: "capture" (keep the
    state after every verified token, copy the accepted one) against "reforward" (snapshot
    before the verify, restore, feed the accepted tokens again).
Writes benchmarks/results/hybrid_cpu.json.

    python benchmarks/hybrid_cpu.py [--threads N] [--repeats R]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import time
from pathlib import Path

import torch

from mtplx.engine.llm_engine import Engine
from mtplx.engine.runner import ModelRunner
from mtplx.engine.sampling import SamplingParams
from mtplx.engine.sequence import Sequence
from mtplx.loading.checkpoint import LoadedModel
from mtplx.loading.weights import build_model_on_meta
from mtplx.models.config import ModelConfig
from mtplx.models.layers import rope_inv_freq

# a Qwen3.5 trunk scaled down: 3 linear-attention layers per full-attention layer
SHAPE = dict(model_type="qwen3_5", vocab_size=8192, hidden_size=512, intermediate_size=1536,
             num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=2, head_dim=64,
             linear_num_key_heads=4, linear_num_value_heads=8, linear_key_head_dim=64,
             linear_value_head_dim=64, linear_conv_kernel_dim=4, rope_parameters={
                 "rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25},
             max_position_embeddings=4096, rms_norm_eps=1e-6)
PROMPT_TOKENS = 64


def random_model(config: ModelConfig) -> torch.nn.Module:
    model = build_model_on_meta(config).to_empty(device="cpu")
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                p.copy_(torch.empty(p.shape).uniform_(0.02, 1.0, generator=g).log())
            elif "norm" in name or name.endswith("dt_bias"):
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) * p.shape[-1] ** -0.5)
    model.rotary.inv_freq = rope_inv_freq(config)
    return model.eval().requires_grad_(False)


def best_times(fn, repeats: int) -> list[float]:
    """Fastest seconds of each phase over ``repeats`` calls; fn returns its phase end times
    (the best, not the median, because the machine may be shared: noise only adds time)."""
    fn()  # warm-up
    best = None
    for _ in range(repeats):
        t0 = time.perf_counter()
        ends = fn()
        phases = [b - a for a, b in zip([t0, *ends], ends)]
        best = phases if best is None else [min(x, y) for x, y in zip(best, phases)]
    return best


def ar_tokens_per_second(model, repeats: int) -> float:
    engine = Engine(LoadedModel(model, None, None, model.config, source=None), kv_cache_tokens=2048)
    prompt = list(range(1, PROMPT_TOKENS + 1))
    best = 0.0
    for _ in range(repeats):
        stats = engine.generate(prompt, mode="ar", max_tokens=64).stats
        best = max(best, stats["decode_tok_s"])
    return best


def step_costs(model, repeats: int) -> dict:
    """AR step seconds, and per (mode, depth, kept): (verify forward, commit_state) seconds."""
    runners = {mode: ModelRunner(model, None, num_blocks=256, block_size=16, state_commit=mode)
               for mode in ("capture", "reforward")}
    seqs = {}
    for mode, runner in runners.items():
        seq = Sequence(prompt_ids=list(range(1, PROMPT_TOKENS + 1)), params=SamplingParams(), max_tokens=1)
        runner.blocks.allocate(seq.seq_id, seq.prompt_ids)
        runner.blocks.ensure_capacity(seq.seq_id, PROMPT_TOKENS + 16)  # the verifies' slots
        seq.state_slot = runner.states.allocate()
        runner.trunk([seq], [seq.prompt_ids], [0])
        seqs[mode] = seq
    pos = PROMPT_TOKENS

    def ar():
        runners["capture"].trunk([seqs["capture"]], [[7]], [pos])
        return [time.perf_counter()]

    out = {"ar_step": best_times(ar, repeats)[0]}
    for depth in (1, 2, 3):
        for kept in (1, depth + 1):
            out["ar_step"] = min(out["ar_step"], best_times(ar, repeats)[0])  # AR under the same load too
            for mode, runner in runners.items():  # modes interleaved: same machine conditions
                def verify(runner=runner, seq=seqs[mode]):
                    runner.trunk([seq], [[7] * (depth + 1)], [pos], keep_states=True)
                    t = time.perf_counter()
                    runner.commit_state([seq], [kept])
                    return [t, time.perf_counter()]

                out[(mode, depth, kept)] = best_times(verify, repeats)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    config = ModelConfig.from_hf(SHAPE)
    model = random_model(config)
    with torch.inference_mode():
        ar_tps = ar_tokens_per_second(model, 3)
        costs = step_costs(model, args.repeats)
    ar = costs["ar_step"]
    ms = lambda s: round(s * 1e3, 3)  # noqa: E731
    verify = {}
    for depth in (1, 2, 3):
        row = {}
        for mode in ("capture", "reforward"):
            (fwd, partial), (_, full) = costs[(mode, depth, 1)], costs[(mode, depth, depth + 1)]
            row[mode] = {"verify_forward_ms": ms(fwd), "commit_partial_ms": ms(partial), "commit_full_ms": ms(full),
                         "step_partial_over_ar": round((fwd + partial) / ar, 3),
                         "step_full_over_ar": round((fwd + full) / ar, 3)}
        verify[f"D={depth}"] = row
    result = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": {"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
                    "cpus": os.cpu_count(), "torch_threads": args.threads, "torch": torch.__version__,
                    "load_average_1m": round(os.getloadavg()[0], 2)},
        "shape": {**SHAPE, "layer_pattern": config.layer_mix()["pattern"], "dtype": "float32",
                  "prompt_tokens": PROMPT_TOKENS},
        "ar_decode_tok_s": round(ar_tps, 2),
        "ar_step_ms": round(ar * 1e3, 3),
        "verify_step": verify,
        "default_state_commit": "capture",
        "notes": "best of --repeats timings per phase; a verify step is the trunk forward over 1 + D tokens "
                 "(reforward: includes the snapshot) plus runner.commit_state; partial = 1 token kept "
                 "(all drafts rejected), full = all kept. reforward pays a second trunk forward on a "
                 "partial acceptance; capture rebuilds the state from the kept updates.",
    }
    path = Path(__file__).parent / "results" / "hybrid_cpu.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
