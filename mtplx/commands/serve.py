"""``mtplx serve``: the OpenAI-compatible server.

Settings come from flags > ``MTPLX_*`` variables > the config file > defaults; the scheduler
settings are validated before the model is loaded, so a bad combination fails in a second
with one line that names the rule.
"""

from __future__ import annotations

import sys
from pathlib import Path

from mtplx.batching.state import SchedulerMode
from mtplx.commands.common import add_model_options
from mtplx.config import Config

# flags that are also config keys (the flag wins when given)
CONFIG_FLAGS = ("model", "scheduler_mode", "generation_mode", "depth", "host", "port", "max_active_requests",
                "decode_batch_max", "batch_wait_ms", "max_queued_requests", "device", "dtype", "api_key")


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
    p.add_argument("--depth", default=None, help="MTP draft depth, 1-8 (default: the engine's)")
    p.add_argument("--max-active-requests", default=None, help="ar_batch: requests decoded together (default 8)")
    p.add_argument("--decode-batch-max", default=None, help="mtp_batch: rows verified per forward (default 8)")
    p.add_argument("--batch-wait-ms", default=None, help="mtp_batch: gather window in ms (default 20)")
    p.add_argument("--max-queued-requests", default=None, help="waiting requests before 503 (default 64)")
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1 routes")
    p.add_argument("--served-model-name", default=None, help="the model id clients send (default: from the path)")
    p.add_argument("--max-body-bytes", type=int, default=4 * 1024 * 1024, help="larger request bodies get 413")
    p.add_argument("--config", default=None, help="config file (default $MTPLX_CONFIG or ~/.mtplx/config.toml)")
    p.add_argument("--log-level", default="info", choices=("critical", "error", "warning", "info", "debug"))
    p.set_defaults(func=run)


def run(args) -> int:
    from mtplx.server import openai
    from mtplx.server.security import check_exposure

    cfg = Config.load(args.config, overrides={k: getattr(args, k) for k in CONFIG_FLAGS})
    settings = openai._validate_scheduler_settings(
        cfg.scheduler_mode, generation_mode=cfg.generation_mode, depth=cfg.depth,
        max_active_requests=cfg.max_active_requests, decode_batch_max=cfg.decode_batch_max,
        batch_wait_ms=cfg.batch_wait_ms, max_queued_requests=cfg.max_queued_requests, sources=cfg.sources)
    check_exposure(cfg.host, cfg.api_key)

    import uvicorn

    import mtplx
    from mtplx.server.app import create_app

    engine = mtplx.load(cfg.model, device=cfg.device, dtype=cfg.dtype, depth=cfg.depth, head=args.head,
                        allow_unverified_head=args.allow_unverified_head)
    openai._validate_model_for_mode(settings, engine.has_mtp)
    model_id = args.served_model_name or served_name(cfg.model)
    app = create_app(engine, settings, model_id=model_id, api_key=cfg.api_key, max_body_bytes=args.max_body_bytes)
    print(f"mtplx serve: {model_id} at http://{cfg.host}:{cfg.port}/v1 (scheduler {settings.mode.value}, "
          f"policy {settings.policy_label}, MTP head: {'yes' if engine.has_mtp else 'no'})", file=sys.stderr)
    uvicorn.run(app, host=cfg.host, port=cfg.port, log_level=args.log_level, timeout_graceful_shutdown=5)
    return 0


def served_name(model: str | None) -> str:
    """The model id: the default model's name, a GGUF file's stem, or a directory's name."""
    if model is None:
        from mtplx.loading.default_model import DEFAULT_MODEL_NAME

        return DEFAULT_MODEL_NAME
    path = Path(model)
    return path.stem if path.suffix == ".gguf" else path.name
