"""Options shared by the subcommands that load a model."""

from __future__ import annotations

import argparse


def add_model_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="HF model directory or .gguf file (default: SmolLM2-135M-Instruct)")
    p.add_argument("--head", default=None, help="directory with a forged mtp.safetensors (default: beside the model; for the default model's GGUF, wherever it lies, the shipped head)")
    p.add_argument("--allow-unverified-head", action="store_true",
                   help="attach a head trained against different trunk weights, labelled unverified")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    p.add_argument("--dtype", default=None, help="float32, bfloat16 or float16 (default: float32 on CPU, bfloat16 on CUDA)")
    p.add_argument("--quantize", default=None, choices=("none", "gguf", "int4", "int8", "fp8"),
                   help="trunk linear weights: gguf runs a GGUF file's own 4/8-bit blocks (fast on the CPU); "
                        "int4/int8/fp8 quantize on load (fp8: CUDA kernels; on the CPU dequantized per "
                        "forward, slow, for quality checks); none: float; default: gguf for a GGUF file "
                        "on the CPU (float32, with the C++ kernels), a quantized checkpoint's own "
                        "integers (AWQ, GPTQ, compressed-tensors, fp8 blocks), else none")
    p.add_argument("--max-depth", type=int, default=None,
                   help="the deepest a depth=auto cycle drafts (default 3)")
    p.add_argument("--kv-dtype", default=None, metavar="DTYPE",
                   help="the KV cache's element type: float16 (the CPU's default for a float32 model: a long "
                        "context's decode reads half as much), float32 (exact entries) or the model's dtype "
                        "(CUDA: only that)")
    p.add_argument("--head-quantize", default=None, choices=("none", "int8", "int4", "fp8"),
                   help="the MTP head's linear weights: int8/int4 round-to-nearest with a scale per 32 inputs, "
                        "fp8 as --quantize; cheaper drafts, outputs still exact (the trunk verifies); "
                        "default none: the head's own dtype")


# the config file's keys that say how a model loads (mtplx.config; serve reads them all)
MODEL_KEYS = ("model", "device", "dtype", "quantize", "max_depth", "kv_dtype", "head_quantize")


def model_config(args, **flags):
    """How the command's model loads: each flag given, else ``MTPLX_<KEY>``, else the config file
    (``mtplx config``), else the default, as ``mtplx serve`` reads them. ``flags``: more keys
    (``depth=args.depth``). Only these keys are read; a bad value of one fails here, naming where
    it came from, before any weight loads."""
    from mtplx.config import Config

    overrides = {**{k: getattr(args, k, None) for k in MODEL_KEYS}, **flags}
    return Config.load(overrides=overrides, keys=tuple(overrides))  # serve's own keys are serve's to check


def load_engine(args, cfg=None, depth=None):
    """The command's engine, as ``model_config`` (or ``cfg``, its result) says."""
    import mtplx

    cfg = cfg if cfg is not None else model_config(args)
    return mtplx.load(cfg.model, device=cfg.device, dtype=cfg.dtype, depth=depth, head=args.head,
                      allow_unverified_head=args.allow_unverified_head, quantize=cfg.quantize,
                      max_depth=cfg.max_depth, kv_dtype=cfg.kv_dtype, head_quantize=cfg.head_quantize)


# a token-id prompt suite for models without a tokenizer
TOKEN_ID_SUITE = ((1, 2, 3, 4), (5, 6, 7, 8, 9), (10, 11, 12))


MAX_DEPTH = 8  # engine.llm_engine.MAX_DEPTH (not imported: the commands check options before torch loads)


def parse_depths(text: str) -> tuple[int | str, ...]:
    """``"1,2,3,auto"`` -> (1, 2, 3, "auto"): at least one, each 1..MAX_DEPTH or auto; a clear
    error names the option otherwise."""
    from mtplx.errors import InvalidParameter

    allowed = f"a comma-separated list of depths from 1 to {MAX_DEPTH} and 'auto'"
    try:  # (an empty entry, "1,,2", is an error: int("") raises)
        depths = tuple(d.strip() if d.strip() == "auto" else int(d) for d in text.split(","))
    except ValueError:
        raise InvalidParameter("depths", f"{text!r} is not {allowed}") from None
    if not depths or any(d != "auto" and not 1 <= d <= MAX_DEPTH for d in depths):
        raise InvalidParameter("depths", f"{text!r} is not {allowed}")
    return depths


def check_measure_options(args) -> None:
    """bench's and tune's options, before the model loads: depths, repeats and max tokens of at
    least 1, and a JSON report path whose folder exists (not found after the run)."""
    from pathlib import Path

    from mtplx.errors import InvalidParameter

    parse_depths(args.depths)
    for name in ("repeats", "max_tokens"):
        if getattr(args, name) < 1:
            raise InvalidParameter(name.replace("_", "-"), f"must be at least 1, got {getattr(args, name)}")
    out = getattr(args, "json_out", None)
    if out and not Path(out).expanduser().resolve().parent.is_dir():
        raise InvalidParameter("json", f"{out!r}: no such folder to write the report in")


def parse_depth(text: str | None) -> int | str | None:
    """A ``--depth`` value: an integer, "auto", or None (not given)."""
    if text is None or text == "auto":
        return text
    from mtplx.errors import InvalidParameter

    try:
        return int(text)
    except ValueError:
        raise InvalidParameter("depth", f"{text!r} is not an integer or 'auto'") from None


def measure_side_by_side(engine, args, depths: str | None = None, **sampling) -> dict:
    """AR and every ``--depths`` depth (or ``depths``) on the prompt suite, interleaved
    (benchmarking.measure)."""
    import sys

    from mtplx.benchmarking import measure

    suite = {} if engine.tokenizer else {"prompts": TOKEN_ID_SUITE}
    return measure(engine, depths=parse_depths(depths or args.depths), max_tokens=args.max_tokens, repeats=args.repeats,
                   progress=lambda label: print(f"  ran {label}", file=sys.stderr), **suite, **sampling)
