"""`kvsp gateway`: serve OpenAI's API in front of a PC (DESIGN §10, README "Gateway").

    kvsp gateway --pc http://127.0.0.1:8470/ --model tiny --listen 127.0.0.1:8000 \\
        [--token-file GW.token] [--principals P.toml --scope-keys K.toml]
        [--instance-api auto|agent|openai]
"""

from __future__ import annotations

import argparse
import logging
import sys
from typing import TYPE_CHECKING

import uvicorn

from kvsp_moq.arguments import parse_listen
from kvsp_moq.auth import add_token_options, token_from_args
from kvsp_moq.errors import KvspError
from kvsp_moq.model_descriptor import DEFAULT_BLOCK_TOKENS, DTYPES
from kvsp_moq.serving import INSECURE_OPEN_HELP, check_exposure, listening
from kvsp_moq.web import uvicorn_config

if TYPE_CHECKING:
    from kvsp_moq.gateway.app import GatewaySettings

log = logging.getLogger("kvsp.gateway")

DEFAULT_PORT = 8000

__all__ = ["DEFAULT_PORT", "configure_parser", "run", "settings_from_args"]


def configure_parser(p: argparse.ArgumentParser) -> None:
    p.description = ("Serve OpenAI's API (/v1/models, /v1/completions, /v1/chat/completions) in "
                     "front of a Placement Controller: tokenize as the model does, route by the "
                     "KVSP cost, generate at the chosen instance and stream the answer back.")
    p.add_argument("--listen", default=f"127.0.0.1:{DEFAULT_PORT}", metavar="HOST:PORT",
                   help="address to serve on (default %(default)s)")
    p.add_argument("--pc", required=True, metavar="URL[,URL...]",
                   help="the Placement Controller; several comma-separated URLs for several PC "
                        "processes on one store (one that cannot be reached or answers 503 is "
                        "left for the next)")
    p.add_argument("--model", required=True, metavar="tiny|DIR",
                   help="the model the instances serve: its tokenizer, chat template and "
                        "descriptor are read from its directory")
    p.add_argument("--model-cache", metavar="DIR",
                   help="where --model tiny is made (as the agent's --model-cache)")
    p.add_argument("--served-model-name", metavar="NAME",
                   help="the model's name in the API (default: <model_type>-<directory name>)")
    p.add_argument("--block-tokens", type=int, default=DEFAULT_BLOCK_TOKENS, metavar="B",
                   help="tokens per block, as the agents (default %(default)s)")
    p.add_argument("--dtype", choices=DTYPES, default="float32",
                   help="the agents' KV dtype, for the compatibility ID (default %(default)s)")
    p.add_argument("--max-tokens", type=int, default=256, metavar="N",
                   help="output tokens of a chat request that names no limit (default %(default)s)")
    p.add_argument("--instance-api", choices=("auto", "agent", "openai"), default="auto",
                   help="what the instances the PC routes to speak: auto (asked once per "
                        "instance: GET /v1/models answers for an OpenAI engine such as vLLM with "
                        "the KVSP connector, else a kvsp agent), agent, or openai "
                        "(default %(default)s)")
    p.add_argument("--principals", metavar="FILE",
                   help="principals file (TOML): callers need role client and the scope; "
                        "without it the gateway runs open, on loopback only")
    p.add_argument("--scope-keys", metavar="FILE",
                   help="keys file (TOML), as the agents': the scopes the gateway keys prompts "
                        "in; without it the open scope")
    p.add_argument("--insecure-open", action="store_true", help=INSECURE_OPEN_HELP)
    add_token_options(p, what="bearer token the gateway presents to the PC and the instances "
                              "(role client, the scopes it serves)")


def settings_from_args(args: argparse.Namespace) -> "GatewaySettings":
    from kvsp_moq.gateway.app import GatewaySettings
    from kvsp_moq.scope_keys import read_scope_keys

    return GatewaySettings(
        pc_url=args.pc, model_dir=model_dir(args.model, args.model_cache),
        served_name=args.served_model_name, token=token_from_args(args),
        principals=args.principals,
        scope_keys=read_scope_keys(args.scope_keys) if args.scope_keys else {},
        block_tokens=args.block_tokens, dtype=args.dtype, default_max_tokens=args.max_tokens,
        instance_api=args.instance_api)


def model_dir(model: str, cache: str | None) -> str:
    """The directory of `--model`: "tiny" is made once where the agent makes it."""
    from agent.settings import AgentSettings, model_directory

    return str(model_directory(AgentSettings(model=model, model_cache=cache)))


def run(args: argparse.Namespace) -> int:
    """Serve in the foreground until interrupted; 2 with one line when options are refused."""
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    try:
        host, port = parse_listen(args.listen, DEFAULT_PORT)
        warnings = check_exposure("the gateway", host, authenticated=args.principals is not None,
                                  open_scope=not args.scope_keys,
                                  insecure_open=args.insecure_open)
        settings = settings_from_args(args)
        from kvsp_moq.gateway.app import create_app

        app = create_app(settings)
        sock = listening(host, port)
    except (KvspError, ValueError, OSError) as e:
        print(f"kvsp gateway: {getattr(e, 'detail', e)}", file=sys.stderr)
        return 2
    for warning in warnings:
        log.warning("%s", warning)
    gw = app.state.gateway
    log.info("gateway for %s (compat %s) at http://%s:%d/v1/, PC %s", gw.model, gw.compat_id,
             host, sock.getsockname()[1], settings.pc_url)
    uvicorn.Server(uvicorn_config(app)).run(sockets=[sock])
    return 0
