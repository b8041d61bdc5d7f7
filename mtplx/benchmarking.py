"""Side-by-side decode measurements: AR and MTP at each depth on the same prompts, interleaved
so machine noise hits every configuration alike. Used by ``mtplx bench``, ``tune`` and ``forge verify``."""

from __future__ import annotations

import platform
import statistics
import time
from dataclasses import dataclass

import torch

# Realistic chat prompts (random tokens would depress MTP acceptance).
BENCH_PROMPTS = (
    "Explain in a few sentences why the sky is blue.",
    "Write a Python function that checks whether a string is a palindrome.",
    "List five tips for staying productive when working from home.",
    "Summarize the plot of Romeo and Juliet in one paragraph.",
    "What are the main differences between a list and a tuple in Python?",
    "Give me a short recipe for pancakes.",
)


@dataclass(frozen=True)
class Config:
    mode: str  # "ar" or "mtp"
    depth: int | str = 0  # 1.., or "auto" (adaptive, up to the engine's max_depth)
    draft_policy: str = "greedy"

    @property
    def label(self) -> str:
        if self.mode == "ar":
            return "ar"
        depth = "auto" if self.depth == "auto" else f"d{self.depth}"
        return f"mtp_{depth}" + ("" if self.draft_policy == "greedy" else f"_{self.draft_policy}")


def configs_for(engine, depths, draft_policies=("greedy",)) -> list[Config]:
    out = [Config("ar")]
    if engine.has_mtp:
        out += [Config("mtp", d, p) for p in draft_policies for d in depths]
    return out


def run_once(engine, prompt, config: Config, max_tokens: int, **sampling) -> dict:
    """One generation; decode time excludes the prompt's prefill (first token)."""
    t0 = time.perf_counter()
    chat = isinstance(prompt, list) and bool(prompt) and isinstance(prompt[0], dict)
    if config.mode == "mtp":
        sampling = {**sampling, "draft_policy": config.draft_policy}
    result = engine.generate(prompt, chat=chat, mode=config.mode,
                             depth=config.depth or None, max_tokens=max_tokens, **sampling)
    elapsed = time.perf_counter() - t0
    s = result.stats
    return {"tokens": s["generated_tokens"], "decode_s": s["decode_s"], "ttft_s": s["ttft_s"], "e2e_s": elapsed,
            "drafted": s["drafted_tokens"], "accepted": s["accepted_tokens"], "verify_calls": s["verify_calls"],
            "drafted_by_depth": s["drafted_by_depth"], "accepted_by_depth": s["accepted_by_depth"],
            "cycles_by_depth": s.get("cycles_by_depth", []), "token_ids": result.token_ids}


def measure(engine, *, depths=(1, 2, 3), prompts=BENCH_PROMPTS, max_tokens: int = 128, repeats: int = 1,
            progress=None, draft_policies=("greedy",), **sampling) -> dict:
    """AR and MTP at each depth (an int, or "auto") and draft policy on every prompt,
    interleaved. With a seed, pass r samples with seed + r: one seed fixes one trajectory per
    prompt and configuration, and a second pass over it would add no draw (H200, session 18:
    one seed had depth 3 at 1.28x AR at T 1.0 and four seeds 1.20x). Returns a JSON-able report."""
    if "draft_policy" in sampling:  # run_once sets each configuration's own: name them in draft_policies
        raise TypeError(f"measure() takes draft_policies=(...), not draft_policy={sampling['draft_policy']!r}")
    configs = configs_for(engine, depths, draft_policies)
    messages = [[{"role": "user", "content": p}] for p in prompts] if engine.tokenizer else list(prompts)
    run_once(engine, messages[0], configs[-1], 8, **sampling)  # warm-up
    runs = {c.label: [] for c in configs}
    for r in range(repeats):
        seeded = pass_sampling(sampling, r)
        for prompt in messages:
            for config in configs:
                runs[config.label].append(run_once(engine, prompt, config, max_tokens, **seeded))
                if progress:
                    progress(config.label)
    report = {"machine": machine_info(engine), "max_tokens": max_tokens, "prompts": len(messages),
              "repeats": repeats, "sampling": sampling, "configs": {}}
    for config in configs:
        report["configs"][config.label] = summarize(runs[config.label], config)
    ar = report["configs"]["ar"]["tok_s"]
    for label, entry in report["configs"].items():
        entry["speedup_vs_ar"] = entry["tok_s"] / ar if ar else None
    report["weights"] = weight_traffic(engine, report["configs"])
    if sampling.get("temperature", 0.0) == 0.0 and engine.has_mtp:
        report["greedy_identical_to_ar"] = all(
            all(r["token_ids"] == a["token_ids"] for r, a in zip(runs[c.label], runs["ar"])) for c in configs)
    return report


def pass_sampling(sampling: dict, r: int) -> dict:
    """The sampling settings of pass r over the prompts: a seeded regime's seed + r (one seed
    is one trajectory per prompt; another pass over it draws nothing new), else as given."""
    return {**sampling, "seed": sampling["seed"] + r} if sampling.get("seed") is not None else sampling


def summarize(runs: list[dict], config: Config) -> dict:
    tokens = sum(r["tokens"] - 1 for r in runs)  # tokens after the first one
    decode_s = sum(r["decode_s"] for r in runs)
    per_run = [(r["tokens"] - 1) / r["decode_s"] for r in runs if r["decode_s"]]
    out = {"mode": config.mode, "depth": config.depth, "draft_policy": config.draft_policy,
           "tok_s": tokens / decode_s if decode_s else 0.0,
           "generated_tokens": sum(r["tokens"] for r in runs),
           "median_ttft_s": statistics.median(r["ttft_s"] for r in runs),
           # one slow run (a compile, another job) drags tok_s down: the spread shows it
           "run_tok_s_min_median": [min(per_run), statistics.median(per_run)] if per_run else None}
    if config.mode == "mtp":
        calls = sum(r["verify_calls"] for r in runs)
        accepted = sum(r["accepted"] for r in runs)
        deepest = max(len(r["drafted_by_depth"]) for r in runs)
        drafted_by, accepted_by, cycles_by = ([sum(r[key][i] for r in runs if len(r[key]) > i) for i in range(deepest)]
                                              for key in ("drafted_by_depth", "accepted_by_depth", "cycles_by_depth"))
        out.update(mean_acceptance_length=1 + accepted / calls if calls else None,
                   mean_depth=sum(r["drafted"] for r in runs) / calls if calls else 0.0,
                   acceptance_rate=accepted / max(1, sum(r["drafted"] for r in runs)),
                   acceptance_by_depth=[a / d if d else 0.0 for a, d in zip(accepted_by, drafted_by)])
        if config.depth == "auto":  # the depths the rows chose: cycles that drafted 1, 2, ... tokens
            out["cycles_by_depth"] = cycles_by
    return out


def weight_traffic(engine, configs: dict) -> dict:
    """Bytes of linear-map weights read per generated token by each configuration, and that
    traffic as a share of the machine's measured memory read bandwidth (CPU). An AR step reads
    the trunk's weights once; an MTP cycle reads them once for its verify plus the head's layer
    and the drafts' output matrix once per drafted token, and yields ``mean_acceptance_length``
    tokens."""
    from mtplx.models.quant import linear_weight_bytes

    model, head = engine.loaded.model, engine.loaded.head
    draft_out = model.draft_lm_head or model.lm_head  # the output matrix drafts read
    trunk = linear_weight_bytes(model) - (linear_weight_bytes(model.draft_lm_head) if model.draft_lm_head else 0)
    per_draft = (linear_weight_bytes(head) + linear_weight_bytes(draft_out)) if head is not None else 0
    bandwidth = memory_read_bandwidth() if engine.device.type == "cpu" else None
    out = {"trunk_bytes": trunk, "memory_read_gb_s": bandwidth, "configs": {}}
    for label, e in configs.items():
        per_token = trunk if e["mode"] == "ar" else (trunk + e["mean_depth"] * per_draft) / (e["mean_acceptance_length"] or 1)
        gb_s = per_token * e["tok_s"] / 1e9
        out["configs"][label] = {"bytes_per_token": round(per_token), "weight_gb_s": gb_s,
                                 "bandwidth_share": gb_s / bandwidth if bandwidth else None}
    return out


def memory_read_bandwidth(nbytes: int = 256 << 20) -> float:
    """GB/s of a sum over a buffer far larger than the caches, with the current thread count
    (best of three)."""
    buf = torch.ones(nbytes // 4)
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        buf.sum()
        best = min(best, time.perf_counter() - t0)
    return nbytes / best / 1e9


def machine_info(engine) -> dict:
    info = {"date": time.strftime("%Y-%m-%d"), "device": str(engine.device), "dtype": str(engine.dtype).replace("torch.", ""),
            "torch": torch.__version__, "cpu": platform.processor() or platform.machine(),
            "threads": torch.get_num_threads()}
    if engine.device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(engine.device)
    return info


def render_table(report: dict) -> str:
    traffic = report.get("weights", {}).get("configs", {})
    rows = [f"{'config':<8} {'tok/s':>8} {'x AR':>6} {'accept len':>10} {'MB/token':>9} {'GB/s':>6} {'of bw':>6}"
            "  acceptance by depth"]
    for label, e in report["configs"].items():
        mal = f"{e['mean_acceptance_length']:.2f}" if e.get("mean_acceptance_length") else "-"
        by = "/".join(f"{a:.2f}" for a in e.get("acceptance_by_depth", [])) or "-"
        t = traffic.get(label, {})
        mb = f"{t['bytes_per_token'] / 1e6:.1f}" if t else "-"
        gbs = f"{t['weight_gb_s']:.1f}" if t else "-"
        share = f"{t['bandwidth_share']:.0%}" if t.get("bandwidth_share") is not None else "-"
        rows.append(f"{label:<8} {e['tok_s']:>8.1f} {e['speedup_vs_ar']:>6.2f} {mal:>10} {mb:>9} {gbs:>6} {share:>6}  {by}")
    bw = report.get("weights", {}).get("memory_read_gb_s")
    if bw:
        rows.append(f"(weights read per token; memory read bandwidth measured at {bw:.1f} GB/s)")
    return "\n".join(rows)
