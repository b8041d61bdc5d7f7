"""``mtplx inspect MODEL``: architecture, size, MTP layout and support tier.

Exit codes: 0 verified (MTP head present and matched to this trunk), 3 unverified head,
4 AR-only (no head), 5 unsupported architecture, 2 unreadable path or file."""

from __future__ import annotations

import json

from mtplx.commands.common import model_config


def add_parser(sub) -> None:
    p = sub.add_parser("inspect", help="describe a model: architecture, MTP head, support tier")
    p.add_argument("model", nargs="?", default=None,
                   help="HF directory or .gguf file (default: the config's model, else the default model)")
    p.add_argument("--head", default=None, help="directory with a forged mtp.safetensors")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=run)


def run(args) -> int:
    from mtplx.loading.describe import TIERS, describe  # PyTorch comes with it: not for the CLI's parser (~2 s)

    model, head = model_config(args).model, args.head  # MODEL, else MTPLX_MODEL, else the config file's
    if model is None:
        from mtplx.loading.default_model import default_head_dir, default_model_path

        model, head = default_model_path(), head or default_head_dir()
    elif head is None:  # the default model's file under another path: its shipped head, as mtplx.load
        from mtplx.loading.default_model import shipped_head_for

        head = shipped_head_for(model)
    info = describe(model, head)
    if args.json:
        print(json.dumps(info, indent=2, default=str))
    else:
        print(_render(info))
    return TIERS[info["tier"]]


def _render(info: dict) -> str:
    lines = [f"model:        {info['path']} ({info['format']})",
             f"architecture: {info['model_type']}"]
    if "parameters" in info:
        lines += [f"parameters:   {info['parameters'] / 1e6:.1f}M (trunk)",
                  f"shape:        {info['layers']} layers, hidden {info['hidden_size']}, "
                  f"{info['attention_heads']} heads / {info['kv_heads']} kv heads, vocab {info['vocab_size']}, "
                  f"context {info['context']}"]
    mix = info.get("layer_mix")
    if mix and mix.get("linear_attention"):
        line = f"layer mix:    {mix['linear_attention']} linear-attention + {mix['full_attention']} full-attention ({mix['pattern']})"
        if mix.get("experts"):
            line += f"; MoE {mix['experts']} in {mix['moe_layers']} layers"
        lines.append(line)
    kv = info.get("kv_cache")
    if kv:
        per = kv["bytes_per_token"]
        lines.append(f"kv cache:     {per['float16']:,} bytes a token in 16 bits (float16: the CPU's default for "
                     f"float32 weights; --kv-dtype), {per['float32']:,} in float32; {kv['attention_layers']} "
                     "attention layers (an MTP head's add theirs)")
    if info.get("prefix_cache", {}).get("enabled") is False:
        lines.append(f"prefix cache: off ({info['prefix_cache']['reason']})")
    for row in info.get("weights", []):
        runs = f"--quantize gguf: {row['runs_as']}" if info["format"] == "gguf" else row["runs_as"]
        lines.append(f"weights:      {row['names']}: {row['stored']} ({runs})")
    mtp = info.get("mtp")
    if mtp:
        lines.append(f"mtp head:     {mtp['layout']} ({mtp['source']}), {mtp['layers']} layer(s), "
                     f"{mtp['parameters'] / 1e6:.1f}M parameters; deeper drafts reuse it recursively")
    lines.append(f"tier:         {info['tier']}")
    if info.get("reason"):
        lines.append(f"note:         {info['reason']}")
    return "\n".join(lines)
