"""Which draft distribution q a sampled row should draft from (issue 15): the expected depth-1
acceptance sum_x min(p(x), q(x)) of several q built from the MTP head's logits, against the
trunk's processed distribution p, at every generated position of the trunk's own sampled
continuations. Exact expectations (no acceptance draws), teacher-forced through the forge's
dense forwards (``forge.dense``: the head's inputs the engine gives it), so a few prompts give a
tight figure. Rejection sampling is exact for any q the drafts are sampled from, so q is free:

- ``argmax``: a one-hot of the head's argmax (the greedy draft policy); acceptance p(argmax);
- ``as_target``: the head's logits processed with the request's own sampler (the mirror policy
  before session 13);
- ``plain_<s>``: softmax(z / (T * s)), no top-k / top-p / min-p (``sampling.draft_params`` with
  DRAFT_SHARPENING = s);
- ``filtered_<s>``: the same with the request's top-p.

    python benchmarks/draft_distribution.py --prompts train --count 24 --out r.json

``--prompts``: ``train`` (the forge's training prompts: where DRAFT_SHARPENING is chosen),
``held`` (the forge's held-out prompts), ``chat`` (benchmarks/sampled_decoding.py's).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

SCALES = (0.5, 0.6, 0.7, 0.8, 0.9, 1.0, 1.1)
REGIMES = ((0.7, 0.95), (1.0, 1.0))  # (temperature, top_p)


def prompt_set(name: str, count: int) -> list[str]:
    from mtplx.forge.prompts import HELD_OUT_PROMPTS, training_prompts

    if name == "chat":
        sys.path.insert(0, str(Path(__file__).parent))
        from sampled_decoding import HELD_OUT_CHAT
        return list(HELD_OUT_CHAT)[:count]
    return (list(HELD_OUT_PROMPTS) if name == "held" else training_prompts(0))[:count]


def candidates(z: torch.Tensor, temperature: float, top_p: float) -> dict[str, torch.Tensor]:
    """Draft distributions [n, V] from head logits z [n, V] (a pruned vocabulary's tokens at
    ``PRUNED_LOGIT``: zero probability), by name; argmax is handled apart."""
    from mtplx.engine.sampling import SamplingParams, logits_to_probs

    out = {"as_target": logits_to_probs(z, SamplingParams(temperature=temperature, top_p=top_p))}
    for s in SCALES:
        out[f"plain_{s}"] = logits_to_probs(z, SamplingParams(temperature=temperature * s))
        if top_p < 1:
            out[f"filtered_{s}"] = logits_to_probs(z, SamplingParams(temperature=temperature * s, top_p=top_p))
    return out


@torch.no_grad()
def expected_acceptance(engine, prompts: list[str], temperature: float, top_p: float, tokens: int) -> dict:
    from mtplx.engine.sampling import SamplingParams, logits_to_probs
    from mtplx.forge.dense import head_outputs, trunk_hidden

    model, head = engine.runner.model, engine.runner.head
    width = model.config.hidden_size
    sums: dict[str, float] = {}
    per_prompt, positions = [], 0
    for i, prompt in enumerate(prompts):
        chat = [{"role": "user", "content": prompt}]
        out = engine.generate(chat, chat=True, mode="ar", max_tokens=tokens, temperature=temperature, top_p=top_p,
                              seed=100 + i)
        prompt_ids = engine.make_request(chat, chat=True).prompt_ids
        ids = torch.tensor(prompt_ids + out.token_ids, device=engine.device)[None]
        hidden = trunk_hidden(model, ids, head.trunk_layers)
        depth1 = head_outputs(head, model, hidden, ids, 1)[0][0]  # pair t predicts token t + 2
        t = torch.arange(len(prompt_ids) - 2, ids.shape[1] - 2, device=ids.device)  # generated tokens t + 2
        z = head.draft_logits(model, depth1[t]).float()
        p = logits_to_probs(model.compute_logits(hidden[0, t + 1, :width]), SamplingParams(temperature=temperature,
                                                                                            top_p=top_p))
        row = {"argmax": float(p.gather(1, z.argmax(-1, keepdim=True)).sum())}
        row.update({name: float(torch.minimum(p, q).sum()) for name, q in candidates(z, temperature, top_p).items()})
        for name, value in row.items():
            sums[name] = sums.get(name, 0.0) + value
        per_prompt.append({"positions": len(t), **{k: round(v / len(t), 4) for k, v in row.items()}})
        positions += len(t)
    return {"positions": positions, "acceptance": {k: round(v / positions, 4) for k, v in sums.items()},
            "per_prompt": per_prompt}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="a .gguf or HF directory (default: the default model)")
    ap.add_argument("--head", default=None)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--quantize", default="none", help="the trunk's weights (default: float)")
    ap.add_argument("--prompts", choices=("train", "held", "chat"), default="train")
    ap.add_argument("--count", type=int, default=24)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()

    import mtplx

    engine = mtplx.load(args.model, device=args.device, head=args.head, quantize=args.quantize)
    prompts = prompt_set(args.prompts, args.count)
    report = {"prompts": args.prompts, "count": len(prompts), "tokens": args.tokens, "regimes": {}}
    for temperature, top_p in REGIMES:
        entry = expected_acceptance(engine, prompts, temperature, top_p, args.tokens)
        report["regimes"][f"t{temperature}" + (f"_p{top_p}" if top_p < 1 else "")] = entry
        print(temperature, top_p, json.dumps(entry["acceptance"]), flush=True)
    Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
