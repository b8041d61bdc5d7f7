"""``mtplx serve``: the OpenAI-compatible server.

Settings come from flags > ``MTPLX_*`` variables > the config file > defaults. Everything
that can fail without the model is checked before it loads (the scheduler settings, an
exposed host without a key, a port in use), so such a mistake fails in a second with one
line. SIGINT/SIGTERM drain the server (``mtplx.server.lifecycle``) and exit 0.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from urllib.parse import urlsplit

from mtplx.batching.state import SchedulerMode
from mtplx.commands.common import add_model_options
from mtplx.config import Config
from mtplx.errors import InvalidParameter

MIB = 1024 * 1024
TOOL_CALL_PARSERS = ("hermes", "qwen3_coder", "llama3_json")  # server/tools.py PARSERS, without importing it
# The --max-body-mb and --shutdown-grace-s defaults are security.DEFAULT_MAX_BODY_BYTES and
# lifecycle.DEFAULT_SHUTDOWN_GRACE_S, written out: building the parser must not import the server.

# flags that are also config keys (the flag wins when given)
CONFIG_FLAGS = ("model", "scheduler_mode", "generation_mode", "depth", "max_depth", "host", "port", "max_active_requests",
                "decode_batch_max", "batch_wait_ms", "max_queued_requests", "device", "dtype", "quantize", "kv_dtype",
                "head_quantize", "tensor_parallel", "api_key")


def add_parser(sub) -> None:
    p = sub.add_parser("serve", help="serve the model over an OpenAI-compatible HTTP API")
    add_model_options(p)
    p.add_argument("--host", default=None, help="address to bind (default 127.0.0.1; others need --api-key)")
    p.add_argument("--port", default=None, help="port (default 8000)")
    p.add_argument("--scheduler-mode", default=None, metavar="MODE",
                   help=f"how concurrent requests share the model: {', '.join(SchedulerMode.choices())} "
                        "(default serial)")
    p.add_argument("--generation-mode", default=None, metavar="mtp|ar",
                   help="default per request (default: mtp when the model has an MTP head)")
    p.add_argument("--depth", default=None,
                   help="MTP draft depth, 1-8, or auto (chosen cycle by cycle; default: the engine's)")
    p.add_argument("--max-active-requests", default=None, help="ar_batch: requests decoded together (default 8)")
    p.add_argument("--decode-batch-max", default=None, help="mtp_batch: rows verified per forward (default 8)")
    p.add_argument("--batch-wait-ms", default=None, help="mtp_batch: gather window in ms (default 20)")
    p.add_argument("--max-queue", "--max-queued-requests", dest="max_queued_requests", default=None, metavar="N",
                   help="waiting requests beyond which new ones get 503 + Retry-After (default 64)")
    p.add_argument("--tensor-parallel", default=None, metavar="N",
                   help="split the model across N processes, one per GPU (NCCL; gloo on the CPU); rank 0 serves "
                        "HTTP, schedules and samples (default 1)")
    p.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' (or 'X-API-Key: KEY') on every route but /health "
                        "and /metrics")
    p.add_argument("--served-model-name", default=None, help="the model id clients send (default: from the path)")
    p.add_argument("--allowed-origin", action="append", default=None, metavar="ORIGIN",
                   help="a web origin (scheme://host[:port], or * for any) whose pages may call the API from a "
                        "browser (CORS; repeatable; default: none)")
    p.add_argument("--max-body-mb", type=_positive_float, default=16.0, metavar="MB",
                   help="request bodies over this many MiB get 413 (default 16)")
    p.add_argument("--shutdown-grace-s", type=_non_negative_float, default=10.0, metavar="S",
                   help="on SIGINT/SIGTERM: seconds in-flight requests may take to finish before they are "
                        "ended with an error (default 10)")
    p.add_argument("--tool-call-parser", default=None, choices=TOOL_CALL_PARSERS,
                   help="the dialect of the model's tool calls (default: from its chat template, else hermes)")
    p.add_argument("--body-timeout-s", type=_positive_float, default=30.0, metavar="S",
                   help="a request body that sends nothing for this long gets 408 and its connection closes "
                        "(default 30)")
    p.add_argument("--config", default=None, help="config file (default $MTPLX_CONFIG or ~/.mtplx/config.toml)")
    p.add_argument("--log-level", default="info", choices=("critical", "error", "warning", "info", "debug"))
    p.set_defaults(func=run)


def is_origin(text: str) -> bool:
    """Whether ``text`` is an origin exactly as a browser sends it in ``Origin`` (CORS matches
    it literally): http or https, a host (an IPv6 one in brackets), a port only where it is not
    the scheme's default, nothing else."""
    try:
        parts = urlsplit(text)
        port = parts.port
    except ValueError:  # a port out of range or not a number
        return False
    host = parts.hostname or ""
    return (parts.scheme in ("http", "https") and bool(host) and "*" not in host and "@" not in parts.netloc
            and not (parts.path or parts.query or parts.fragment or text.endswith(("?", "#")))
            and port != 0 and port != {"http": 80, "https": 443}[parts.scheme]
            and text == f"{parts.scheme}://{parts.netloc}" and parts.netloc == parts.netloc.lower())


def _positive_float(text: str) -> float:
    value = _non_negative_float(text)
    if value == 0:
        raise argparse.ArgumentTypeError("must be greater than 0")
    return value


def _non_negative_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a number >= 0, got {text}")
    return value


def run(args) -> int:
    from mtplx.batching import settings as scheduler_settings
    from mtplx.server.lifecycle import DrainingServer, listen, uvicorn_config
    from mtplx.server.security import check_exposure

    for origin in args.allowed_origin or ():
        if origin != "*" and not is_origin(origin):
            raise InvalidParameter("allowed-origin", f"{origin!r} is not an origin as a browser sends it: "
                                                     "http(s)://host[:port] (e.g. http://localhost:3000; no path, "
                                                     "no user, no wildcard, no default port), or *")
    for flag in ("api_key", "served_model_name"):  # given, but empty: a mistake, not "none"
        if getattr(args, flag) is not None and not getattr(args, flag).strip():
            raise InvalidParameter(flag.replace("_", "-"), "is empty" + (
                " (leave --api-key out to serve without a key)" if flag == "api_key" else
                " (leave it out to serve the model's name from its path)"))
    cfg = Config.load(args.config, overrides={k: getattr(args, k) for k in CONFIG_FLAGS})
    settings = scheduler_settings.validate_scheduler_settings(
        cfg.scheduler_mode, generation_mode=cfg.generation_mode, depth=cfg.depth,
        max_active_requests=cfg.max_active_requests, decode_batch_max=cfg.decode_batch_max,
        batch_wait_ms=cfg.batch_wait_ms, max_queued_requests=cfg.max_queued_requests, sources=cfg.sources)
    check_exposure(cfg.host, cfg.api_key)
    sock = listen(cfg.host, cfg.port)  # connections made while the model loads wait in the backlog

    import mtplx
    from mtplx.server.app import create_app

    with sock:
        engine = mtplx.load(cfg.model, device=cfg.device, dtype=cfg.dtype, depth=cfg.depth, head=args.head,
                            allow_unverified_head=args.allow_unverified_head, quantize=cfg.quantize,
                            max_depth=cfg.max_depth, tensor_parallel=cfg.tensor_parallel, kv_dtype=cfg.kv_dtype,
                            head_quantize=cfg.head_quantize)
        scheduler_settings.validate_model_for_mode(settings, engine.has_mtp)
        model_id = args.served_model_name or served_name(cfg.model)
        app = create_app(engine, settings, model_id=model_id, api_key=cfg.api_key,
                         max_body_bytes=int(args.max_body_mb * MIB), tool_call_parser=args.tool_call_parser,
                         body_timeout_s=args.body_timeout_s, allowed_origins=args.allowed_origin)
        print(f"mtplx serve: {model_id} at http://{_url_host(cfg.host)}:{cfg.port}/v1 (scheduler "
              f"{settings.mode.value}, policy {settings.policy_label}, MTP head: {'yes' if engine.has_mtp else 'no'}); "
              f"dashboard at http://{_url_host(cfg.host)}:{cfg.port}/dashboard", file=sys.stderr)
        if (estimate := engine.estimate_summary()) is not None:
            print(f"mtplx serve: not tuned on this machine; requests naming no mode or depth follow the head's recorded "
                  f"acceptance and {engine.costs_source} cycle costs: {estimate} (`mtplx tune` measures them)",
                  file=sys.stderr)
        server = DrainingServer(uvicorn_config(app, args.log_level), app.state.mtplx.scheduler, args.shutdown_grace_s)
        tp = engine.tensor_parallel
        if tp is not None:  # a rank that dies fails the requests in flight (500) and ends the server
            pids = ", ".join(f"rank {r} pid {p.pid}" for r, p in enumerate(tp.workers, start=1))
            print(f"mtplx serve: tensor parallel over {tp.world} ranks (rank 0 pid {os.getpid()}, {pids})",
                  file=sys.stderr)
            tp.watch(server.abort)
        try:
            server.run(sockets=[sock])
        finally:
            if tp is not None:
                tp.close()
    if server.failure is not None:
        print(f"mtplx serve: stopped: {server.failure}", file=sys.stderr)
        return 1
    return 0


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def served_name(model: str | None) -> str:
    """The model id: the default model's name, a GGUF file's stem, or a directory's name."""
    if model is None:
        from mtplx.loading.default_model import DEFAULT_MODEL_NAME

        return DEFAULT_MODEL_NAME
    path = Path(model)
    return path.stem if path.suffix == ".gguf" else path.name
