"""``mtplx generate PROMPT``: stream a completion to stdout."""

from __future__ import annotations

import json
import sys

from mtplx.commands.common import add_model_options, load_engine, model_config, parse_depth


def add_parser(sub) -> None:
    p = sub.add_parser("generate", help="generate text from a prompt (streams to stdout)")
    p.add_argument("prompt", help="the prompt text, or - to read it from standard input")
    add_model_options(p)
    p.add_argument("--chat", action="store_true", help="wrap the prompt as a user message in the chat template")
    p.add_argument("--mode", choices=("ar", "mtp"), default=None, help="default: mtp when the model has a head")
    p.add_argument("--depth", type=parse_depth, default=None,
                   help="MTP draft depth, or auto (chosen cycle by cycle; default: tuned, else what the head's recorded acceptance "
                        "and this machine kind's cycle costs expect fastest, else 1)")
    p.add_argument("--draft-policy", choices=("auto", "greedy", "mirror"), default="auto")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    p.add_argument("--stats", action="store_true", help="print decoding statistics to stderr")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of streaming")
    p.set_defaults(func=run)


def run(args) -> int:
    from mtplx.engine.sampling import SamplingParams
    from mtplx.errors import InvalidParameter

    # every option is checked before the model loads
    cfg = model_config(args, depth=args.depth, generation_mode=args.mode)
    if args.max_tokens < 1:
        raise InvalidParameter("max-tokens", f"must be at least 1, got {args.max_tokens}")
    SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, min_p=args.min_p,
                   seed=args.seed).validate()
    prompt_text = sys.stdin.read() if args.prompt == "-" else args.prompt
    engine = load_engine(args, cfg)
    prompt = [{"role": "user", "content": prompt_text}] if args.chat else prompt_text
    kwargs = dict(mode=cfg.generation_mode, depth=cfg.depth, max_tokens=args.max_tokens, temperature=args.temperature,
                  top_p=args.top_p, top_k=args.top_k, min_p=args.min_p, seed=args.seed, stop=args.stop,
                  chat=args.chat, draft_policy=args.draft_policy)
    req = engine.make_request(prompt, **kwargs)
    pieces = []
    for seq, piece in engine.run(req):
        pieces.append(piece)
        if not args.json and piece:
            sys.stdout.write(piece)
            sys.stdout.flush()
    result = engine.result(seq, "".join(pieces))
    if args.json:
        print(json.dumps({"text": result.text, "token_ids": result.token_ids, "finish_reason": result.finish_reason,
                          "prompt_tokens": result.prompt_tokens, "stats": result.stats}))
    else:
        sys.stdout.write("\n")
    if args.stats:
        s = result.stats
        line = f"[{s['mode']}] {s['generated_tokens']} tokens, ttft {s['ttft_s']:.3f}s"
        if s.get("decode_tok_s"):
            line += f", {s['decode_tok_s']:.1f} tok/s"
        if s["verify_calls"]:
            line += (f", depth {s['depth']}, acceptance {s['acceptance_rate']:.2f}, "
                     f"mean acceptance length {s['mean_acceptance_length']:.2f}, by position "
                     + "/".join(f"{a:.2f}" for a in s["acceptance_rate_by_position"]))
        print(line, file=sys.stderr)
    return 0
