"""mtplx against llama.cpp on the CPU, side by side in one process, on the same GGUF file.

Both run the default model (SmolLM2-135M-Instruct, Q4_1) from the same file with the same
thread count (default: the physical cores), the same prompt token ids and the same number of
generated tokens (EOS ignored), in interleaved order so machine noise hits both alike:

  decode:   mtplx AR greedy, MTP greedy (depth 1), AR and MTP at temperature 0.7, and llama.cpp
            (llama-cpp-python) greedy and at temperature 0.7; tok/s after the first token.
  prefill:  one long prompt (--long-prompt-tokens, default 7,900) through each; tok/s.
  quality:  mtplx's greedy output from the file's own quantized weights against the same
            weights dequantized to float32, first --quality-tokens (64) tokens per prompt.

llama-cpp-python is built from source by pip when it is not importable (about 4-5 minutes on two
free cores, far longer on a busy machine; the build runs under `nice`).

    python benchmarks/cpu_vs_llama_cpp.py [--threads N] [--tokens 96] [--repeats 2]
        [--long-prompt-tokens 7900] [--json benchmarks/results/cpu_vs_llama_cpp.json]
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

# prompts not used to tune anything in mtplx (benchmarking.BENCH_PROMPTS are the tuning set)
PROMPTS = (
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "How does a hash map handle collisions? Explain with an example.",
    "Give three arguments for and against remote work.",
    "Describe the water cycle to a ten-year-old.",
)
QUALITY_PROMPTS = PROMPTS + (
    "What is the capital of Australia, and why is it not Sydney?",
    "Translate 'good morning, how are you?' into French and Spanish.",
    "Write a Python function that returns the n-th Fibonacci number.",
    "List the planets of the solar system in order from the sun.",
)
LONG_TEXT = ("The history of computing is a story of abstraction: each generation of engineers builds "
             "tools that hide the details the previous generation had to manage by hand. ")
BUILD_ARGS = ("-DLLAVA_BUILD=OFF -DLLAMA_BUILD_TOOLS=OFF -DLLAMA_BUILD_EXAMPLES=OFF "
              "-DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_SERVER=OFF")


def physical_cores() -> int:
    """Distinct (socket, core) pairs in /proc/cpuinfo; os.cpu_count() where that is unreadable."""
    try:
        pairs, phys = set(), None
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("physical id"):
                phys = line.split(":")[1].strip()
            elif line.startswith("core id"):
                pairs.add((phys, line.split(":")[1].strip()))
        return len(pairs) or os.cpu_count() or 1
    except OSError:
        return os.cpu_count() or 1


def ensure_llama_cpp() -> tuple[object, float]:
    """Import llama_cpp, building llama-cpp-python with pip first when it is missing.
    Returns (module, build seconds or 0)."""
    try:
        return importlib.import_module("llama_cpp"), 0.0
    except ImportError:
        pass
    print("building llama-cpp-python with pip (minutes)...", file=sys.stderr)
    t0 = time.perf_counter()
    env = {**os.environ, "CMAKE_ARGS": BUILD_ARGS, "CMAKE_BUILD_PARALLEL_LEVEL": str(os.cpu_count() or 2)}
    subprocess.run(["nice", "-n", "10", sys.executable, "-m", "pip", "install", "llama-cpp-python"],
                   check=True, env=env)
    return importlib.import_module("llama_cpp"), time.perf_counter() - t0


class LlamaCpp:
    """llama-cpp-python on token ids: prefill, then one token per eval."""

    def __init__(self, module, path: Path, threads: int, n_ctx: int, extra_buffers: bool):
        if not extra_buffers:
            # llama.cpp's extra CPU buffer types (AMX, repacked weights) crash (SIGSEGV in the
            # first eval) in this project's VM, whose CPU reports AMX: load without them
            default = module.llama_cpp.llama_model_default_params

            def params():
                p = default()
                p.use_extra_bufts = False
                return p
            module.llama.llama_cpp.llama_model_default_params = params
        self.llm = module.Llama(model_path=str(path), n_threads=threads, n_threads_batch=threads, n_ctx=n_ctx,
                                n_batch=512, verbose=False, seed=0)

    def decode(self, ids: list[int], tokens: int, temperature: float) -> dict:
        self.llm.reset()
        t0 = time.perf_counter()
        out, first = [], None
        sampling = {"temp": temperature, "top_k": 1 if temperature == 0 else 0, "top_p": 1.0, "min_p": 0.0,
                    "repeat_penalty": 1.0}
        for tok in self.llm.generate(ids, reset=True, **sampling):
            out.append(int(tok))
            if first is None:
                first = time.perf_counter()
            if len(out) == tokens:
                break
        end = time.perf_counter()
        return {"tokens": len(out), "decode_s": end - first, "ttft_s": first - t0, "token_ids": out}

    def prefill(self, ids: list[int]) -> float:
        self.llm.reset()
        t0 = time.perf_counter()
        self.llm.eval(ids)
        return time.perf_counter() - t0


def mtplx_decode(engine, ids, tokens, mode, temperature, seed) -> dict:
    r = engine.generate(ids, mode=mode, max_tokens=tokens, temperature=temperature, seed=seed, ignore_eos=True)
    s = r.stats
    return {"tokens": s["generated_tokens"], "decode_s": s["decode_s"], "ttft_s": s["ttft_s"],
            "token_ids": r.token_ids, "accepted": s["accepted_tokens"], "verify_calls": s["verify_calls"]}


def summarize(runs: list[dict]) -> dict:
    tokens = sum(r["tokens"] - 1 for r in runs)
    decode = sum(r["decode_s"] for r in runs)
    out = {"tok_s": tokens / decode if decode else 0.0, "runs": len(runs),
           "run_tok_s": [round((r["tokens"] - 1) / r["decode_s"], 1) for r in runs if r["decode_s"]]}
    if any("verify_calls" in r and r["verify_calls"] for r in runs):
        calls = sum(r["verify_calls"] for r in runs)
        out["mean_acceptance_length"] = 1 + sum(r["accepted"] for r in runs) / calls
    return out


def quality(engine_q, engine_f, prompts, tokens: int) -> dict:
    """Greedy tokens of the quantized model against the dequantized float32 one."""
    rows = []
    for p in prompts:
        ids = engine_q.encode_prompt([{"role": "user", "content": p}], chat=True)
        a = engine_q.generate(ids, mode="ar", max_tokens=tokens, ignore_eos=True).token_ids
        b = engine_f.generate(ids, mode="ar", max_tokens=tokens, ignore_eos=True).token_ids
        same = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a))
        rows.append({"prompt": p, "identical_prefix": same})
    return {"tokens": tokens, "prompts": len(rows), "identical": sum(r["identical_prefix"] == tokens for r in rows),
            "rows": rows}


def _write(path: str, report: dict) -> None:
    """The report so far (each phase adds to it, so a failure late keeps what ran)."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(report, indent=2))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=physical_cores())
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--depth", type=int, default=1)
    ap.add_argument("--long-prompt-tokens", type=int, default=7900)
    ap.add_argument("--quality-tokens", type=int, default=64)
    ap.add_argument("--llama-extra-buffers", action="store_true",
                    help="let llama.cpp use its AMX / repacked-weight CPU buffers (they crash in this project's VM)")
    ap.add_argument("--skip", default="", help="comma-separated phases to skip: decode, prefill, quality")
    ap.add_argument("--json", default="benchmarks/results/cpu_vs_llama_cpp.json")
    args = ap.parse_args()
    skip = set(filter(None, args.skip.split(",")))

    import torch

    import mtplx
    from mtplx.loading.default_model import default_model_path

    torch.set_num_threads(args.threads)
    need_llama = not {"decode", "prefill"} <= skip
    llama_cpp, build_s = ensure_llama_cpp() if need_llama else (None, 0.0)
    path = default_model_path()
    engine = mtplx.load(None, device="cpu", depth=args.depth, quantize="gguf",
                        kv_cache_tokens=args.long_prompt_tokens + 512)
    engine_bf16 = mtplx.load(None, device="cpu", dtype="bfloat16", depth=args.depth, quantize="gguf",
                             kv_cache_tokens=1024)
    llama = (LlamaCpp(llama_cpp, path, args.threads, args.long_prompt_tokens + 512, args.llama_extra_buffers)
             if need_llama else None)
    report = {"date": datetime.date.today().isoformat(), "cpu": platform.processor() or platform.machine(),
              "threads": args.threads, "torch": torch.__version__,
              "llama_cpp_python": getattr(llama_cpp, "__version__", None),
              "llama_cpp_build_s": round(build_s, 1), "llama_cpp_extra_buffers": args.llama_extra_buffers,
              "model": str(path), "tokens": args.tokens,
              "repeats": args.repeats, "load_average_start": os.getloadavg()}

    if "decode" not in skip:
        configs = {
            "mtplx_ar_greedy": lambda ids, s: mtplx_decode(engine, ids, args.tokens, "ar", 0.0, s),
            "mtplx_mtp_greedy": lambda ids, s: mtplx_decode(engine, ids, args.tokens, "mtp", 0.0, s),
            "llama_cpp_greedy": lambda ids, s: llama.decode(ids, args.tokens, 0.0),
            "mtplx_ar_t0.7": lambda ids, s: mtplx_decode(engine, ids, args.tokens, "ar", 0.7, s),
            "mtplx_mtp_t0.7": lambda ids, s: mtplx_decode(engine, ids, args.tokens, "mtp", 0.7, s),
            "llama_cpp_t0.7": lambda ids, s: llama.decode(ids, args.tokens, 0.7),
            # activations, KV cache and the MTP head in bf16 too (the weights are the same blocks)
            "mtplx_ar_greedy_bf16": lambda ids, s: mtplx_decode(engine_bf16, ids, args.tokens, "ar", 0.0, s),
            "mtplx_mtp_greedy_bf16": lambda ids, s: mtplx_decode(engine_bf16, ids, args.tokens, "mtp", 0.0, s),
        }
        prompts = [engine.encode_prompt([{"role": "user", "content": p}], chat=True) for p in PROMPTS]
        for fn in configs.values():  # warm-up
            fn(prompts[0][:8], 0)
        runs = {k: [] for k in configs}
        for rep in range(args.repeats):
            for i, ids in enumerate(prompts):
                for label, fn in configs.items():
                    runs[label].append(fn(ids, 1000 * rep + i))
                    print(f"  {label}: {runs[label][-1]['tokens']} tokens", file=sys.stderr)
        decode = {k: summarize(v) for k, v in runs.items()}
        llama_tok_s = decode["llama_cpp_greedy"]["tok_s"]
        for k, v in decode.items():
            v["x_llama_cpp_greedy"] = v["tok_s"] / llama_tok_s if llama_tok_s else None
        decode["mtp_greedy_x_ar"] = decode["mtplx_mtp_greedy"]["tok_s"] / decode["mtplx_ar_greedy"]["tok_s"]
        decode["mtp_t0.7_x_ar_t0.7"] = decode["mtplx_mtp_t0.7"]["tok_s"] / decode["mtplx_ar_t0.7"]["tok_s"]
        decode["mtp_greedy_bf16_x_ar_bf16"] = (decode["mtplx_mtp_greedy_bf16"]["tok_s"]
                                               / decode["mtplx_ar_greedy_bf16"]["tok_s"])
        decode["greedy_first_tokens_equal_llama_cpp"] = sum(
            a["token_ids"][:16] == b["token_ids"][:16] for a, b in zip(runs["mtplx_ar_greedy"], runs["llama_cpp_greedy"]))
        report["decode"] = decode

    _write(args.json, report)

    if "prefill" not in skip:
        text = LONG_TEXT * (args.long_prompt_tokens // 20)
        ids = engine.tokenizer.encode(text)[: args.long_prompt_tokens]
        t0 = time.perf_counter()
        engine.generate(ids, mode="ar", max_tokens=1)
        ours = time.perf_counter() - t0
        theirs = llama.prefill(ids)
        report["prefill"] = {"prompt_tokens": len(ids), "mtplx_s": ours, "llama_cpp_s": theirs,
                             "mtplx_tok_s": len(ids) / ours, "llama_cpp_tok_s": len(ids) / theirs,
                             "mtplx_x_llama_cpp": theirs / ours}

    _write(args.json, report)

    if "quality" not in skip:
        floats = mtplx.load(None, device="cpu", quantize="none")
        report["quality"] = quality(engine, floats, QUALITY_PROMPTS, args.quality_tokens)
    report["load_average_end"] = os.getloadavg()

    _write(args.json, report)
    print(json.dumps({k: v for k, v in report.items() if k != "quality"}, indent=2, default=str))
    if "quality" in report:
        q = report["quality"]
        print(f"quality: {q['identical']}/{q['prompts']} prompts identical for {q['tokens']} greedy tokens; "
              f"identical prefixes {[r['identical_prefix'] for r in q['rows']]}")


if __name__ == "__main__":
    main()
