"""Options shared by the subcommands that load a model."""

from __future__ import annotations

import argparse


def add_model_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="HF model directory or .gguf file (default: SmolLM2-135M-Instruct)")
    p.add_argument("--head", default=None, help="directory with a forged mtp.safetensors (default: beside the model)")
    p.add_argument("--allow-unverified-head", action="store_true",
                   help="attach a head trained against different trunk weights, labelled unverified")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    p.add_argument("--dtype", default=None, help="float32, bfloat16 or float16 (default: float32 on CPU, bfloat16 on CUDA)")


def load_engine(args, depth=None):
    import mtplx

    return mtplx.load(args.model, device=args.device, dtype=args.dtype, depth=depth, head=args.head,
                      allow_unverified_head=args.allow_unverified_head)
