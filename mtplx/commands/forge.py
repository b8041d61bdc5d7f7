"""``mtplx forge build`` trains an MTP head for a trunk; ``mtplx forge verify`` checks that a head
decodes exactly, measures its held-out acceptance and whether it is faster than AR on this
machine, and with ``--against`` (``--replace``) refuses to (or does) replace another head that
accepts more (less)."""

from __future__ import annotations

import shlex
import sys
import time
from pathlib import Path

from mtplx.commands.common import add_model_options, load_engine


def add_parser(sub) -> None:
    p = sub.add_parser("forge", help="train an MTP head for a model (build) or check one (verify)")
    actions = p.add_subparsers(dest="forge_action", required=True, metavar="ACTION")
    _add_build(actions)
    _add_verify(actions)


def _add_build(actions) -> None:
    p = actions.add_parser("build", help="train an MTP head by self-distillation against the frozen trunk")
    p.add_argument("--model", default=None, help="HF model directory or .gguf file (default: SmolLM2-135M-Instruct)")
    p.add_argument("--out", default=None, help="folder for mtp.safetensors and mtplx_forge.json "
                                               "(required unless --corpus-only)")
    p.add_argument("--work", default=None, help="folder for the corpus and checkpoints (default: OUT/forge-work)")
    p.add_argument("--resume", action="store_true", help="continue an interrupted build from its work folder")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    p.add_argument("--dtype", default="float32", help="trunk dtype for data and targets (default float32)")
    p.add_argument("--seed", type=int, default=0)
    g = p.add_argument_group("data")
    g.add_argument("--tokens", type=int, default=1_000_000, help="generated tokens to aim for (default 1M)")
    g.add_argument("--max-new-tokens", type=int, default=256, help="longest completion per prompt")
    g.add_argument("--temperatures", default="0,0.7,1.0",
                   help="sampling temperatures, mixed over prompts and rounds (default 0,0.7,1.0)")
    g.add_argument("--rounds", type=int, default=3, help="passes over the prompt set, at most")
    g.add_argument("--gen-rows", type=int, default=None,
                   help="sequences generated together (default: 128 on the CPU; on a GPU as many as half its "
                        "free memory holds, up to 2048)")
    g.add_argument("--prompts", default=None, help="JSON list of training prompts (default: the built-in set)")
    g.add_argument("--text", action="append", default=[], help="plain-text file to add (repeatable)")
    g.add_argument("--self-prompts", type=int, default=0,
                   help="user messages the trunk writes itself, added to the prompts (default 0: none; "
                        "needs a chat template; the shipped head's corpus used them, see docs/forge.md)")
    g.add_argument("--self-prompt-temperature", type=float, default=0.9,
                   help="sampling temperature of the self-generated prompts (default 0.9)")
    g.add_argument("--self-prompt-share", type=float, default=0.15,
                   help="the share of --max-seconds after which self-prompt generation stops (default 0.15)")
    g.add_argument("--corpus", action="append", default=[],
                   help="train on this stored corpus (an earlier build's corpus.pt) instead of generating one; "
                        "repeat it to train on several as one")
    g.add_argument("--corpus-only", action="store_true",
                   help="generate the corpus into the work folder (WORK/corpus.pt: token ids, int32) and stop")
    g = p.add_argument_group("head")
    g.add_argument("--features", default="final", choices=("final", "prenorm", "fuse3"),
                   help="what the head reads of the trunk: final (the final-normed hidden state), prenorm (the "
                        "last layer's output before the final norm), fuse3 (EAGLE-3: layers L/4, L/2 and the last, "
                        "projected to the hidden size)")
    g.add_argument("--head-layers", type=int, default=1, choices=(1, 2), help="decoder layers in the head")
    g.add_argument("--second-mlp", type=int, default=0,
                   help="with --head-layers 2: the second layer's MLP width (0: the trunk's); a narrower one "
                        "keeps a two-layer head smaller")
    g.add_argument("--draft-vocab", type=int, default=0,
                   help="draft only from the N most frequent corpus tokens (FR-Spec; 0: the whole vocabulary)")
    g = p.add_argument_group("training")
    g.add_argument("--depth", type=int, default=3, help="draft depths trained (default 3)")
    g.add_argument("--epochs", type=float, default=3.0)
    g.add_argument("--batch-tokens", type=int, default=8192, help="tokens per training batch")
    g.add_argument("--lr", type=float, default=1e-3, help="peak learning rate (AdamW, cosine decay)")
    g.add_argument("--start-from", default="",
                   help="continue training this forged head (same trunk, same form) instead of starting "
                        "from the trunk's last layer; its draft vocabulary is chosen again")
    g.add_argument("--max-seconds", type=float, default=None,
                   help="wall-clock budget: self prompts stop at 15%% of it, completions at 45%%, "
                        "training at 90%%")
    g = p.add_argument_group("measurement")
    g.add_argument("--measure-depth", type=int, default=3)
    g.add_argument("--measure-max-tokens", type=int, default=128)
    g.add_argument("--measure-temperatures", default="0,0.7,1.0",
                   help="held-out acceptance at each temperature (0: greedy; others: mirror drafts)")
    p.set_defaults(func=run_build)


def _add_verify(actions) -> None:
    p = actions.add_parser("verify", help="exactness checks and the speed verdict of a head on this machine")
    add_model_options(p)
    p.add_argument("--depths", default="1,2,3", help="MTP depths to time against AR")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--samples", type=int, default=300, help="MTP generations in the sampled-distribution test")
    p.add_argument("--no-write", action="store_true", help="do not record the verdict in mtplx_forge.json")
    g = p.add_argument_group("held-out acceptance")
    g.add_argument("--acceptance-temperatures", default="0,0.7,1.0",
                   help="held-out acceptance by depth at each temperature (0: greedy; others: mirror drafts)")
    g.add_argument("--acceptance-depth", type=int, default=3)
    g.add_argument("--acceptance-max-tokens", type=int, default=128)
    g.add_argument("--acceptance-seeds", type=int, default=3,
                   help="draws (a seed each) pooled at each sampled temperature (default 3; greedy runs once)")
    g.add_argument("--against", default=None,
                   help="a head folder (e.g. the shipped one) to measure the same way; exits non-zero if "
                        "--head's mean acceptance length is lower at any measured temperature")
    g.add_argument("--replace", action="store_true",
                   help="with --against: copy --head over it, only if --head measures at least as well")
    p.set_defaults(func=run_verify)


def _refuse_head_quantize(args) -> None:
    """``forge verify`` measures a head in its own dtype: a quantized head's acceptance is not the
    shipped head's (and a verdict recorded from it would say otherwise)."""
    from mtplx.errors import InvalidParameter

    if getattr(args, "head_quantize", None) not in (None, "none"):
        raise InvalidParameter("head_quantize", "forge trains and measures heads in their own dtype; "
                                                "--head-quantize is for serving (mtplx serve, generate, bench)")


def run_build(args) -> int:
    from mtplx.errors import InvalidParameter
    from mtplx.forge import prompts
    from mtplx.forge.build import BuildSettings, build, load_prompts_file, load_trunk
    from mtplx.forge.measure import acceptance_line
    from mtplx.forge.train import TrainSettings

    temperatures = parse_temperatures(args.temperatures, "temperatures")
    measure_temperatures = parse_temperatures(args.measure_temperatures, "measure-temperatures")
    if args.out is None and not args.corpus_only:
        raise InvalidParameter("out", "give the folder for the head (--out), or --corpus-only with --work")
    if args.corpus_only and args.work is None:
        raise InvalidParameter("work", "--corpus-only writes WORK/corpus.pt: give --work")
    if args.draft_vocab < 0:
        raise InvalidParameter("draft-vocab", f"must be >= 0 (0: the whole vocabulary), got {args.draft_vocab}")
    if args.second_mlp < 0 or (args.second_mlp and args.head_layers < 2):
        raise InvalidParameter("second-mlp", f"must be >= 0 (0: the trunk's width) and needs --head-layers 2, "
                                             f"got {args.second_mlp} with --head-layers {args.head_layers}")
    for name in ("tokens", "max_new_tokens", "rounds", "gen_rows", "depth", "batch_tokens", "measure_depth"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            raise InvalidParameter(name.replace("_", "-"), f"must be >= 1, got {getattr(args, name)}")
    if args.self_prompts < 0:
        raise InvalidParameter("self-prompts", f"must be >= 0 (0: none), got {args.self_prompts}")
    if not args.self_prompt_temperature > 0:
        raise InvalidParameter("self-prompt-temperature", f"must be > 0, got {args.self_prompt_temperature}")
    if not 0 < args.self_prompt_share < 1:
        raise InvalidParameter("self-prompt-share", f"must lie between 0 and 1, got {args.self_prompt_share}")
    train_prompts = load_prompts_file(Path(args.prompts)) if args.prompts else prompts.training_prompts(args.seed)
    settings = BuildSettings(
        tokens=args.tokens, max_new_tokens=args.max_new_tokens, temperatures=temperatures, rounds=args.rounds,
        gen_rows=args.gen_rows, seed=args.seed, self_prompt_temperature=args.self_prompt_temperature,
        self_prompt_share=args.self_prompt_share,
        max_seconds=args.max_seconds, measure_depth=args.measure_depth,
        measure_max_tokens=args.measure_max_tokens, measure_temperatures=measure_temperatures,
        features=args.features, head_layers=args.head_layers, draft_vocab=args.draft_vocab,
        second_mlp=args.second_mlp,
        train=TrainSettings(depth=args.depth, lr=args.lr, epochs=args.epochs, batch_tokens=args.batch_tokens,
                            seed=args.seed, start_from=args.start_from))
    trunk = load_trunk(args.model, device=args.device, dtype=args.dtype)
    settings.self_prompts = args.self_prompts
    held_out = list(prompts.HELD_OUT_PROMPTS)
    if trunk.loaded.tokenizer is None and args.prompts:  # token-id prompts: hold out the last few
        cut = max(1, len(train_prompts) // 10)
        train_prompts, held_out = train_prompts[:-cut], train_prompts[-cut:]
    command = "mtplx " + " ".join(shlex.quote(a) for a in sys.argv[1:]) if sys.argv[1:2] == ["forge"] else ""
    provenance = build(trunk, Path(args.out) if args.out else None, train_prompts=train_prompts,
                       held_out_prompts=held_out, settings=settings, work_dir=Path(args.work) if args.work else None,
                       resume=args.resume, text_files=[Path(t) for t in args.text],
                       prompt_source=args.prompts or prompts.PROMPT_SET_VERSION, command=command,
                       corpus_files=[Path(c) for c in args.corpus], corpus_only=args.corpus_only)
    if args.corpus_only:
        print(f"corpus: {Path(args.work) / 'corpus.pt'}")
        return 0
    measured = provenance["measured"]
    print(f"forged {args.out}: held-out acceptance by depth (mean acceptance length) "
          + acceptance_line({"greedy": measured["held_out"], "sampled": measured["held_out_sampled"]}))
    return 0


def parse_temperatures(text: str, option: str) -> tuple[float, ...]:
    """``"0,0.7,1.0"`` -> (0.0, 0.7, 1.0); a clear error names the option otherwise."""
    from mtplx.errors import InvalidParameter

    try:
        temperatures = tuple(float(t) for t in text.split(",") if t.strip())
    except ValueError:
        raise InvalidParameter(option, f"{text!r} is not a comma-separated list") from None
    if not temperatures or any(t < 0 for t in temperatures):
        raise InvalidParameter(option, "give one or more temperatures >= 0")
    return temperatures


def run_verify(args) -> int:
    from mtplx.benchmarking import render_table
    from mtplx.commands.common import TOKEN_ID_SUITE, measure_side_by_side, parse_depths
    from mtplx.errors import InvalidParameter
    from mtplx.forge.artifact import read_provenance, write_provenance
    from mtplx.forge.measure import acceptance_line, sampled_exactness
    from mtplx.forge.prompts import HELD_OUT_PROMPTS, as_chat
    from mtplx.tuning import pick_depth

    parse_depths(args.depths)  # a bad value fails before the model loads
    _refuse_head_quantize(args)
    temperatures = parse_temperatures(args.acceptance_temperatures, "acceptance-temperatures")
    if args.acceptance_seeds < 1:
        raise InvalidParameter("acceptance-seeds", f"must be >= 1, got {args.acceptance_seeds}")
    if args.replace and not (args.against and args.head):
        raise InvalidParameter("replace", "--replace copies --head over --against: give both")
    engine = load_engine(args)
    if not engine.has_mtp:
        raise InvalidParameter("head", "this model has no MTP head to verify (pass --head DIR)")
    held = held_out_acceptance(engine, args, temperatures)
    print(f"held-out acceptance by depth (mean acceptance length), {args.head or 'this head'}: "
          + acceptance_line(held))
    report = measure_side_by_side(engine, args)
    greedy_ok = bool(report.get("greedy_identical_to_ar"))
    print(f"greedy identity with AR: {'pass' if greedy_ok else 'FAIL'}")
    prompt = (engine.tokenizer.apply_chat_template(as_chat(HELD_OUT_PROMPTS[0])) if engine.tokenizer
              else list(TOKEN_ID_SUITE[0]))
    sampled = sampled_exactness(engine, prompt, samples=args.samples)
    sampled_ok = sampled["p_value"] >= 1e-3
    print(f"sampled distribution (chi-square, {sampled['samples']} MTP samples vs the enumerated AR "
          f"distribution): p = {sampled['p_value']:.3g}, {'pass' if sampled_ok else 'FAIL'}")
    print(render_table(report))
    choice = pick_depth(report)
    print(choice["message"])
    head_dir = Path(args.head) if args.head else Path(engine.loaded.head_info.get("source", ""))
    if not args.no_write and (head_dir / "mtplx_forge.json").is_file():
        verdict = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "machine": report["machine"],
                   "greedy_identical_to_ar": greedy_ok, "sampled_exactness": sampled,
                   "speed": {k: {"tok_s": round(v["tok_s"], 2), "acceptance_by_depth": v.get("acceptance_by_depth"),
                                 "mean_acceptance_length": v.get("mean_acceptance_length")}
                             for k, v in report["configs"].items()},
                   "verdict": choice["message"], "fastest_depth": choice["depth"], "held_out_acceptance": held}
        try:
            write_provenance(head_dir, {**read_provenance(head_dir), "verify": verdict})
            print(f"recorded the verdict in {head_dir / 'mtplx_forge.json'}")
        except OSError as exc:
            print(f"could not record the verdict in {head_dir}: {exc}", file=sys.stderr)
    if not (greedy_ok and sampled_ok):
        return 1
    return compare_heads(args, held, temperatures) if args.against else 0


def held_out_acceptance(engine, args, temperatures) -> dict:
    """Acceptance by depth on the held-out prompts (chat template; a trunk without a tokenizer:
    the token-id suite), at each temperature (``measure.acceptance_by_temperature``)."""
    from mtplx.commands.common import TOKEN_ID_SUITE
    from mtplx.forge.measure import acceptance_by_temperature
    from mtplx.forge.prompts import HELD_OUT_PROMPTS, as_chat

    prompts = ([engine.tokenizer.apply_chat_template(as_chat(p)) for p in HELD_OUT_PROMPTS] if engine.tokenizer
               else [list(p) for p in TOKEN_ID_SUITE])
    return acceptance_by_temperature(engine, prompts, temperatures=temperatures, depth=args.acceptance_depth,
                                     max_tokens=args.acceptance_max_tokens, rows=8, seeds=args.acceptance_seeds)


def compare_heads(args, held: dict, temperatures) -> int:
    """Measure the --against head as --head was; refuse (non-zero) where --head measures worse:
    a lower mean acceptance length (at ``--acceptance-depth``) at any measured temperature, greedy
    or sampled. With --replace copy --head over --against where it does not."""
    import shutil
    from argparse import Namespace

    from mtplx.forge.measure import acceptance_line
    from mtplx.loading.mtp_weights import SIDECAR_PROVENANCE, SIDECAR_WEIGHTS

    other = load_engine(Namespace(**{**vars(args), "head": args.against}))
    theirs = held_out_acceptance(other, args, temperatures)
    print(f"held-out acceptance by depth (mean acceptance length), {args.against}: " + acceptance_line(theirs))
    worse = measures_worse(held, theirs)
    if worse:
        print(f"forge verify: {args.head} accepts less than {args.against} at {', '.join(worse)}; "
              f"keeping {args.against}", file=sys.stderr)
        return 3
    print(f"{args.head} accepts at least as much as {args.against} at every temperature measured")
    if args.replace:
        for name in (SIDECAR_WEIGHTS, SIDECAR_PROVENANCE):
            shutil.copyfile(Path(args.head) / name, Path(args.against) / name)
        print(f"replaced the head in {args.against} with {args.head}")
    return 0


def measures_worse(ours: dict, theirs: dict) -> list[str]:
    """The regimes (each temperature both heads were measured at, ``held_out_acceptance``'s
    results) where ours has the lower mean acceptance length, e.g. ``["T 1 (1.850 < 1.860)"]``;
    prints each comparison, with depth 1's acceptance beside it."""
    from mtplx.errors import InvalidParameter

    pairs = [("greedy", ours["greedy"], theirs["greedy"])] if ours.get("greedy") and theirs.get("greedy") else []
    pairs += [(f"T {t}", r, theirs["sampled"][t]) for t, r in ours["sampled"].items() if t in theirs["sampled"]]
    if not pairs:
        raise InvalidParameter("against", "the two heads share no measured temperature")
    worse = []
    for regime, new, old in pairs:
        a, b = new["mean_acceptance_length"] or 0.0, old["mean_acceptance_length"] or 0.0
        print(f"  {regime}: mean acceptance length {a:.3f} vs {b:.3f} "
              f"(depth 1: {new['acceptance_by_depth'][0]:.3f} vs {old['acceptance_by_depth'][0]:.3f})")
        if a < b:
            worse.append(f"{regime} ({a:.3f} < {b:.3f})")
    return worse
