"""What a forged head is worth: acceptance per depth on held-out prompts (greedy, batched
through the engine), and an exactness test of MTP sampling against the trunk's own
distribution, enumerated exactly."""

from __future__ import annotations

from collections import Counter

import torch

from mtplx.engine.llm_engine import Engine
from mtplx.engine.sampling import SamplingParams, logits_to_probs
from mtplx.forge.data import decode_rows
from mtplx.forge.dense import trunk_hidden

EOS = -1  # marks "the generation ended here" in an enumerated outcome


def acceptance(engine: Engine, prompts: list[list[int]], *, depth: int, max_tokens: int = 128,
               rows: int = 32, temperature: float = 0.0, seed: int = 0) -> dict:
    """MTP at ``depth`` over the prompts (token ids, chat template applied by the caller):
    greedy, or at ``temperature`` > 0 sampled with mirror drafts (drafts sampled from the
    head's distribution, what rejection sampling accepts most often), prompt i with seed
    ``seed + i``.

    Returns acceptance_by_depth (the share of cycles whose draft i was accepted, i = 1..depth:
    position 1 is "depth-1 acceptance"), mean_acceptance_length (1 + accepted / verify calls,
    bonus token included), and the totals."""
    sampling = dict(temperature=temperature, draft_policy="mirror") if temperature > 0 else {}
    requests = ((str(i), engine.make_request(p, mode="mtp", depth=depth, max_tokens=max_tokens, seed=seed + i,
                                             **sampling))
                for i, p in enumerate(prompts))
    drafted, accepted = [0] * depth, [0] * depth
    calls = tokens = 0
    for _, seq in decode_rows(engine, requests, rows):
        st = seq.stats
        calls += st.verify_calls
        tokens += st.generated_tokens
        for i, (d, a) in enumerate(zip(st.drafted_by_depth, st.accepted_by_depth)):
            drafted[i] += d
            accepted[i] += a
    return _report(depth, temperature, len(prompts), tokens, calls, drafted, accepted)


def _report(depth: int, temperature: float, prompts: int, tokens: int, calls: int, drafted: list[int],
            accepted: list[int], seeds: int = 1) -> dict:
    return {"depth": depth, "temperature": temperature, "prompts": prompts, "seeds": seeds,
            "generated_tokens": tokens, "verify_calls": calls, "drafted": drafted, "accepted": accepted,
            "acceptance_by_depth": [a / d if d else 0.0 for a, d in zip(accepted, drafted)],
            "mean_acceptance_length": 1 + sum(accepted) / calls if calls else None}


def pooled(reports: list[dict]) -> dict:
    """``acceptance`` reports of the same prompts and depth (other seeds) as one: counts summed."""
    first = reports[0]
    depth = first["depth"]
    return _report(depth, first["temperature"], first["prompts"], sum(r["generated_tokens"] for r in reports),
                   sum(r["verify_calls"] for r in reports),
                   [sum(r["drafted"][i] for r in reports) for i in range(depth)],
                   [sum(r["accepted"][i] for r in reports) for i in range(depth)],
                   sum(r.get("seeds", 1) for r in reports))


SEED_STRIDE = 100_003  # between the seeds of a temperature's draws (prompt i adds i)


def acceptance_by_temperature(engine: Engine, prompts: list[list[int]], *, temperatures, depth: int,
                              max_tokens: int = 128, rows: int = 32, seed: int = 0, seeds: int = 1) -> dict:
    """``acceptance`` at each temperature: {"greedy": report at 0 (if asked), "sampled":
    {"0.7": report, ...}}. seeds: draws at each temperature above 0, pooled (draw k seeds prompt
    i with ``seed + k * SEED_STRIDE + i``): one seed is one trajectory per prompt, and a head's
    sampled acceptance over 24 prompts moves by a few hundredths between draws. Greedy decoding
    draws nothing, so it runs once."""
    out: dict = {"sampled": {}}
    for temperature in temperatures:
        draws = 1 if temperature == 0 else seeds
        report = pooled([acceptance(engine, prompts, depth=depth, max_tokens=max_tokens, rows=rows,
                                    temperature=temperature, seed=seed + k * SEED_STRIDE) for k in range(draws)])
        if temperature == 0:
            out["greedy"] = report
        else:
            out["sampled"][f"{temperature:g}"] = report
    return out


def acceptance_line(measured: dict) -> str:
    """``T 0: 0.460/0.200/0.100 (1.76), T 0.7: ...``: acceptance by depth and, in brackets, the
    mean acceptance length, from ``acceptance_by_temperature``'s result."""
    reports = ([("0", measured["greedy"])] if measured.get("greedy") else []) + list(measured["sampled"].items())
    return ", ".join(f"T {t}: " + "/".join(f"{a:.3f}" for a in r["acceptance_by_depth"])
                     + f" ({r['mean_acceptance_length'] or 0:.2f})" for t, r in reports)


def step_costs(engine: Engine, prompt: list[int], steps: int = 200) -> dict:
    """Seconds of one row's draft step (a head forward of one pair fed its own output, then the
    draft logits and their argmax, as a host-path draft step runs them: through the engine's
    graphs where captured) and of one AR trunk step, each the median of ``steps`` timed after
    warm-up. The row is thrown away afterwards (the steps rewrite KV entries of its prompt)."""
    import statistics
    import time

    runner = engine.runner
    seq = engine.new_sequence(engine.make_request(prompt, mode="mtp", max_tokens=1))
    sync = torch.cuda.synchronize if engine.device.type == "cuda" else (lambda: None)
    with torch.inference_mode():
        engine.generator.admit(seq)
        engine.generator.prefill(seq)
        at = seq.trunk_len - 1
        h = torch.zeros(1, 1, engine.config.hidden_size, dtype=engine.dtype, device=engine.device)
        token = [[prompt[-1]]]

        def draft():
            out = runner.head_forward([seq], h, token, [at])
            return runner.draft_logits(out[:, 0]).argmax(-1)

        def ar():
            return runner.logits(runner.trunk([seq], token, [at])[:, 0]).argmax(-1)

        costs = {}
        for name, work in (("draft_step_s", draft), ("ar_step_s", ar)):
            times = []
            for i in range(steps + 10):
                sync()
                t0 = time.perf_counter()
                work()
                sync()
                if i >= 10:
                    times.append(time.perf_counter() - t0)
            costs[name] = statistics.median(times)
    engine.generator.release(seq)
    return costs


# -- exactness of sampled MTP decoding -------------------------------------------------------------

def exact_distribution(engine: Engine, prompt: list[int], params: SamplingParams, steps: int) -> dict[tuple, float]:
    """P(first ``steps`` generated tokens) under AR sampling with ``params``, by enumeration:
    outcome tuples of token ids, ending with EOS when the trunk stops early. Keep the sampler's
    support small (top_k) so the tree stays small: top_k ** steps leaves at most."""
    eos = engine.generator.eos_token_ids
    out: dict[tuple, float] = {}
    frontier = [((), 1.0)]
    for step in range(steps):
        nxt = []
        for prefix, mass in frontier:
            probs = _next_probs(engine, prompt + list(prefix), params)
            for token in torch.nonzero(probs > 0).flatten().tolist():
                p = mass * float(probs[token])
                if token in eos:
                    out[prefix + (EOS,)] = out.get(prefix + (EOS,), 0.0) + p
                elif step == steps - 1:
                    out[prefix + (token,)] = p
                else:
                    nxt.append((prefix + (token,), p))
        frontier = nxt
    return out


def _next_probs(engine: Engine, ids: list[int], params: SamplingParams) -> torch.Tensor:
    model = engine.loaded.model
    # over the engine's own cache type: the distribution its MTP samples must match
    hidden = trunk_hidden(model, torch.tensor([ids], device=engine.device), kv_dtype=engine.runner.cache.kv_dtype)
    logits = model.compute_logits(hidden[:, -1])
    return logits_to_probs(logits, params)[0].float().cpu()


def sampled_outcomes(engine: Engine, prompt: list[int], params: SamplingParams, steps: int, samples: int, *,
                     depth: int, draft_policy: str = "mirror", seed: int = 0) -> Counter:
    """Outcomes of ``samples`` seeded MTP generations of ``steps`` tokens (same encoding as
    ``exact_distribution``)."""
    counts: Counter = Counter()
    for i in range(samples):
        result = engine.generate(prompt, mode="mtp", depth=depth, max_tokens=steps, temperature=params.temperature,
                                 top_k=params.top_k, top_p=params.top_p, seed=seed + i, draft_policy=draft_policy)
        ended = (EOS,) if result.finish_reason == "stop" else ()
        counts[tuple(result.token_ids) + ended] += 1
    return counts


def chi_square(counts: Counter, expected_probs: dict[tuple, float], min_expected: float = 5.0) -> dict:
    """Goodness of fit of ``counts`` to ``expected_probs``; outcomes expected fewer than
    ``min_expected`` times are pooled into one bin. An outcome with probability 0 is a failure."""
    n = sum(counts.values())
    impossible = [k for k in counts if expected_probs.get(k, 0.0) == 0.0]
    if impossible:
        return {"samples": n, "p_value": 0.0, "impossible_outcomes": [list(k) for k in impossible[:5]]}
    bins, pooled_obs, pooled_exp = [], 0, 0.0
    for outcome, p in expected_probs.items():
        if n * p >= min_expected:
            bins.append((counts.get(outcome, 0), n * p))
        else:
            pooled_obs += counts.get(outcome, 0)
            pooled_exp += n * p
    if pooled_exp > 0:
        bins.append((pooled_obs, pooled_exp))
    stat = sum((o - e) ** 2 / e for o, e in bins)
    dof = max(1, len(bins) - 1)
    p_value = float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64),
                                            torch.tensor(stat / 2, dtype=torch.float64)))
    return {"samples": n, "bins": len(bins), "chi2": stat, "dof": dof, "p_value": p_value}


def sampled_exactness(engine: Engine, prompt: list[int], *, samples: int = 300, depth: int = 2, steps: int = 3,
                      temperature: float = 1.0, top_k: int = 4, seed: int = 0, draft_policy: str = "mirror") -> dict:
    """Does MTP sampling reproduce the trunk's distribution over the first ``steps`` tokens?
    A chi-square test of ``samples`` MTP generations against the enumerated AR distribution."""
    params = SamplingParams(temperature=temperature, top_k=top_k)
    with torch.inference_mode():
        expected = exact_distribution(engine, prompt, params, steps)
    counts = sampled_outcomes(engine, prompt, params, steps, samples, depth=depth, draft_policy=draft_policy, seed=seed)
    report = chi_square(counts, expected)
    report.update(depth=depth, steps=steps, temperature=temperature, top_k=top_k, draft_policy=draft_policy,
                  outcomes=len(expected))
    return report
