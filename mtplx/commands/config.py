"""``mtplx config show|get|set|unset|path``: read and write ``~/.mtplx/config.toml``."""

from __future__ import annotations

import json

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
    elif args.action == "set":
        value = set_value(args.key, args.value)
        print(f"{args.key} = {_show(args.key, value)}  (saved to {config_path()})")
    elif args.action == "unset":
        unset_value(args.key)
        print(f"{args.key} removed from {config_path()}")
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


def _show(key: str, value) -> str:
    if value is None:
        return {"model": "default", "api_key": "none"}.get(key, "auto")
    if KEYS[key].secret:
        return "***"
    return str(value)
