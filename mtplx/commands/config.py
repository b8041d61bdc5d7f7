"""``mtplx config show|get|set|unset|path``: read and write ``~/.mtplx/config.toml``."""

from __future__ import annotations

import json
import sys

from mtplx.config import KEYS, Config, config_path, set_value, unset_value


def add_parser(sub) -> None:
    p = sub.add_parser("config", help="show or change saved settings (~/.mtplx/config.toml)")
    actions = p.add_subparsers(dest="action", required=True, metavar="ACTION")
    show = actions.add_parser("show", help="every key, its effective value and where it comes from")
    show.add_argument("--json", action="store_true")
    get = actions.add_parser("get", help="the effective value of one key")
    get.add_argument("key", choices=list(KEYS), metavar="KEY")
    put = actions.add_parser("set", help="save a value (checked first); 'auto' removes the key")
    put.add_argument("key", choices=list(KEYS), metavar="KEY")
    put.add_argument("value")
    unset = actions.add_parser("unset", help="remove a key from the file (back to the default; an unknown key "
                                              "the file holds too)")
    unset.add_argument("key", metavar="KEY")
    actions.add_parser("path", help="the config file's path")
    p.set_defaults(func=run)


def run(args) -> int:
    if args.action == "path":
        print(config_path())
    elif args.action in ("set", "unset"):
        if args.action == "set":
            value = set_value(args.key, args.value)
            print(f"{args.key} = {_show(args.key, value)}  (saved to {config_path()})")
        else:
            if unset_value(args.key):
                print(f"{args.key} removed from {config_path()}")
            else:
                print(f"{args.key} is not set in {config_path()}: nothing to remove")
        if (problem := _serve_would_refuse()) is not None:
            print(f"warning: as it stands `mtplx serve` would refuse these settings: {problem}", file=sys.stderr)
    elif args.action == "get":
        print(_show(args.key, Config.load().as_dict()[args.key]))
    else:
        cfg = Config.load()
        values = cfg.as_dict()
        if args.json:
            print(json.dumps({k: {"value": v, "source": cfg.source(k)} for k, v in values.items()}, indent=2))
        else:
            width = max(map(len, values))
            for key, value in values.items():
                print(f"{key:<{width}}  {_show(key, value):<24}  ({cfg.source(key)})")
    return 0


def _serve_would_refuse() -> str | None:
    """What `mtplx serve` would refuse in the settings now in force (file and environment), as it
    checks them before loading a model; None if nothing. Flags given to serve may still mend it."""
    from mtplx.batching import settings as scheduler_settings
    from mtplx.errors import MtplxError
    from mtplx.server.security import check_exposure

    try:
        cfg = Config.load()
        scheduler_settings.validate_scheduler_settings(
            cfg.scheduler_mode, generation_mode=cfg.generation_mode, depth=cfg.depth,
            max_active_requests=cfg.max_active_requests, decode_batch_max=cfg.decode_batch_max,
            batch_wait_ms=cfg.batch_wait_ms, max_queued_requests=cfg.max_queued_requests, sources=cfg.sources)
        check_exposure(cfg.host, cfg.api_key)
    except MtplxError as exc:
        return str(exc)
    return None


def _show(key: str, value) -> str:
    if value is None:  # an unset depth is the engine's per-request choice, not the value "auto" (adaptive)
        return {"model": "default", "api_key": "none", "depth": "engine default"}.get(key, "auto")
    if KEYS[key].secret:
        return "***"
    return str(value)
