"""The tuned decoding per (model, head, device, dtype): ``~/.mtplx/tuning.json``.

``mtplx tune`` measures AR and each depth side by side, twice: greedy, and sampled at
``SAMPLED`` (temperature 0.7, top-p 0.95, a fixed seed), since MTP can pay for one and not the
other. For each regime it saves the fastest depth when one beats AR, and otherwise that AR is
fastest there (a depth whose acceptance is below ``COLLAPSE`` counts as collapsed, never as a
winner). ``mtplx.load`` (so ``generate`` and ``serve``) reads it with ``tuned``: the greedy
verdict gives the depth when none is given, and AR as the engine's default generation mode when
MTP did not pay; the sampled verdict does the same for requests with temperature > 0 (a
request can still ask for a mode and a depth).

File layout: {"version": 1, "entries": {key: {"depth" or "mode": "ar", "tok_s", "ar_tok_s",
"speedup", "acceptance_by_depth", "measured_at", "machine", "sampled": {"depth" or "mode": "ar",
"tok_s", "ar_tok_s", "speedup", "acceptance_by_depth", "sampling"}}}}; the top level is the
greedy verdict (an AR verdict has "best_mtp_tok_s" instead of "speedup" and
"acceptance_by_depth"), "sampling" holds the settings measured ({"temperature", "top_p",
"seed"}), and an entry without "sampled" (written before sampled tuning) tunes greedy only.
The key names the trunk (path and size), the head's source, the device type and the dtype, and
the KV cache's element type where it is not the model's dtype (the CPU's float16 cache reads half
the bytes a step: a verdict measured over a float32 cache is not its own).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

COLLAPSE = 0.05  # acceptance below this is a collapsed head, not a speed-up candidate
VERSION = 1  # entries gained "sampled" without a bump: older files read the same
SAMPLED = {"temperature": 0.7, "top_p": 0.95, "seed": 1234}  # the sampled regime `mtplx tune` measures


def tuning_path() -> Path:
    """``~/.mtplx/tuning.json``."""
    return Path.home() / ".mtplx" / "tuning.json"


def model_key(loaded, device, dtype, kv_dtype=None) -> str:
    """Identifies what a tuned depth was measured for. ``loaded``: a LoadedModel; ``kv_dtype``:
    the KV cache's element type (None or the model's dtype: not part of the key). A forged
    head counts by its folder and, where its record holds one, its weights' sha256 (before
    session 31 by its folder alone, so a verdict outlived the head it was measured with)."""
    source = Path(loaded.source).expanduser().resolve() if loaded.source else None
    size = _size(source) if source else 0
    info = (loaded.head_info or {}) if loaded.head is not None else {}
    head = info.get("source", "")
    sha = (info.get("provenance") or {}).get("weights_sha256")
    if sha:  # a forged head replaced in place (a new shipped head) is another head: tune again
        head = f"{head}@{sha[:16]}"
    key = f"{source}:{size}|head={head}|{getattr(device, 'type', device)}|{str(dtype).replace('torch.', '')}"
    if kv_dtype is not None and kv_dtype != dtype:
        key += f"|kv={str(kv_dtype).replace('torch.', '')}"
    # quantized weights change what a cycle costs: a float model's verdict is not theirs
    quantized = getattr(loaded, "quantize", None)
    key = f"{key}|quantize={quantized}" if quantized else key
    head_quantized = getattr(loaded, "head_quantize", None)  # a quantized head: cheaper drafts, other acceptance
    return f"{key}|head_quantize={head_quantized}" if head_quantized else key


def read_tuning(path: Path | None = None) -> dict:
    """The whole file ({} entries when it is absent or unreadable: a bad file only loses tuning)."""
    path = path or tuning_path()
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return {"version": VERSION, "entries": {}}
    if not isinstance(data, dict) or not isinstance(data.get("entries"), dict):
        return {"version": VERSION, "entries": {}}
    return data


def tuned(loaded, device, dtype, path: Path | None = None, kv_dtype=None) -> dict:
    """What ``mtplx tune`` saved for this model on this device and dtype. The greedy verdict:
    {"depth": d}, {"mode": "ar"} (no depth beat AR), or none (not tuned, or a malformed entry);
    plus, where the entry holds a valid one, the sampled verdict as "sampled": {"depth": d} or
    {"mode": "ar"}. E.g. {"depth": 1, "sampled": {"mode": "ar"}}; {} when nothing is tuned."""
    if loaded.head is None:
        return {}
    entry = read_tuning(path)["entries"].get(model_key(loaded, device, dtype, kv_dtype))
    if not isinstance(entry, dict):
        return {}
    choice, sampled = _verdict(entry), _verdict(entry.get("sampled"))
    return {**choice, "sampled": sampled} if sampled else choice


def _verdict(entry) -> dict:
    """One regime's saved verdict: {"mode": "ar"}, {"depth": d} (d: 1..8 or "auto"), or {} when
    absent or malformed; with "depth_costs" (a DepthCosts) where the entry holds valid ones."""
    if not isinstance(entry, dict):
        return {}
    costs = _costs(entry.get("depth_costs"))
    extra = {"depth_costs": costs} if costs else {}
    if entry.get("mode") == "ar":
        return {"mode": "ar", **extra}
    depth = entry.get("depth")
    if depth == "auto" or isinstance(depth, int) and not isinstance(depth, bool) and 1 <= depth <= 8:
        return {"depth": depth, **extra}
    return {}


def _costs(saved):
    """A saved cycle-cost table ({"cycles": [...], "per_draft": x}) as DepthCosts, or None."""
    from mtplx.engine.adaptive_depth import DepthCosts

    try:
        cycles = tuple(float(c) for c in saved["cycles"])
        per_draft = float(saved["per_draft"])
    except (TypeError, KeyError, ValueError):
        return None
    return DepthCosts(cycles, per_draft) if cycles and all(c > 0 for c in cycles) and per_draft > 0 else None


def depth_costs(report: dict, draft_policy: str = "greedy"):
    """The cycle costs (DepthCosts) implied by a ``benchmarking.measure`` report of AR and fixed
    depths 1..n side by side (their cycles drafting under ``draft_policy``), or None where
    depth 1 is missing."""
    from mtplx.engine.adaptive_depth import DepthCosts

    configs = report["configs"]
    fixed = {e["depth"]: e for e in configs.values() if e["mode"] == "mtp" and isinstance(e["depth"], int)
             and e.get("draft_policy", "greedy") == draft_policy}
    depths = [d for d in range(1, len(fixed) + 1) if d in fixed]
    return DepthCosts.from_measurement(configs["ar"]["tok_s"], {d: fixed[d]["tok_s"] for d in depths},
                                       {d: fixed[d]["acceptance_by_depth"] for d in depths})


def tuned_depth(loaded, device, dtype, path: Path | None = None, kv_dtype=None) -> int | None:
    """The saved depth for this model on this device and dtype, or None (use the default).

    For an ``Engine``: ``tuned_depth(engine.loaded, engine.device, engine.dtype,
    kv_dtype=engine.runner.cache.kv_dtype)``."""
    return tuned(loaded, device, dtype, path, kv_dtype).get("depth")


def pick_depth(report: dict, collapse: float = COLLAPSE) -> dict:
    """The fastest MTP depth of a benchmarking.measure report, if it beats AR.

    Returns {"depth": int or None, "ar_tok_s", "tok_s", "speedup", "collapsed": [depths], "message"}."""
    configs = report["configs"]
    ar = configs["ar"]["tok_s"]
    candidates, collapsed = [], []
    for entry in configs.values():
        if entry["mode"] != "mtp":
            continue
        if (entry.get("acceptance_rate") or 0.0) < collapse:
            collapsed.append(entry["depth"])
        else:
            candidates.append(entry)
    best = max(candidates, key=lambda e: e["tok_s"], default=None)
    note = f" (depth {', '.join(map(str, collapsed))} collapsed: acceptance < {collapse})" if collapsed else ""
    if best is None or best["tok_s"] <= ar:
        return {"depth": None, "ar_tok_s": ar, "tok_s": ar, "speedup": 1.0, "collapsed": collapsed,
                "message": f"no MTP depth beat AR ({ar:.1f} tok/s){note}"}
    speedup = best["tok_s"] / ar if ar else float("inf")
    return {"depth": best["depth"], "ar_tok_s": ar, "tok_s": best["tok_s"], "speedup": speedup, "collapsed": collapsed,
            "message": f"depth {best['depth']} is fastest: {ar:.1f} -> {best['tok_s']:.1f} tok/s, {speedup:.2f}x{note}"}


def save_choice(loaded, device, dtype, choice: dict, report: dict, path: Path | None = None, *,
                sampled: tuple[dict, dict] | None = None, kv_dtype=None) -> Path:
    """Record the greedy verdict (``choice``, a ``pick_depth`` of ``report``): the winning depth
    (an int or "auto"), or, with no winner, that AR is the fastest here, replacing any earlier
    entry for this key; with the cycle costs depth="auto" uses (``choice["depth_costs"]``, a
    DepthCosts, where measured). ``sampled``: the (choice, report) of the sampled measurement,
    recorded under "sampled" with its sampling settings. Returns the path written."""
    path = path or tuning_path()
    data = read_tuning(path)
    entry = {**_verdict_record(choice, report), "measured_at": time.strftime("%Y-%m-%d %H:%M:%S"),
             "machine": report.get("machine")}
    if sampled is not None:
        sampled_choice, sampled_report = sampled
        entry["sampled"] = {**_verdict_record(sampled_choice, sampled_report),
                            "sampling": sampled_report.get("sampling")}
    data["entries"][model_key(loaded, device, dtype, kv_dtype)] = entry
    data["version"] = VERSION
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    os.replace(tmp, path)
    return path


def _verdict_record(choice: dict, report: dict) -> dict:
    """A ``pick_depth`` verdict and the figures behind it, as saved."""
    costs = choice.get("depth_costs")
    saved = {"depth_costs": {"cycles": [round(c, 4) for c in costs.cycles], "per_draft": round(costs.per_draft, 4)}} \
        if costs is not None else {}
    return {**_figures(choice, report), **saved}


def _figures(choice: dict, report: dict) -> dict:
    if choice["depth"] is None:
        mtp = [c["tok_s"] for label, c in report["configs"].items() if label != "ar"]
        return {"mode": "ar", "tok_s": round(choice["ar_tok_s"], 2), "ar_tok_s": round(choice["ar_tok_s"], 2),
                "best_mtp_tok_s": round(max(mtp), 2) if mtp else None}
    label = "mtp_auto" if choice["depth"] == "auto" else f"mtp_d{choice['depth']}"
    by_depth = report["configs"].get(label, {})
    return {"depth": choice["depth"], "tok_s": round(choice["tok_s"], 2), "ar_tok_s": round(choice["ar_tok_s"], 2),
            "speedup": round(choice["speedup"], 3), "acceptance_by_depth": by_depth.get("acceptance_by_depth")}


def _size(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    if path.is_dir():
        return sum(f.stat().st_size for f in path.glob("*.safetensors"))
    return 0
