"""`kvsp agent` as the fleet runs it: the same command line, the same checks and serving, with
an optional pause between output tokens, so that a fault can be made to land in the middle of a
streamed session (the tiny model otherwise finishes one before a test can act).

    python -m kvsp_moq.fleet.agent [--token-interval-s S] KVSP-AGENT-OPTIONS...
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

from kvsp_moq.errors import KvspError


def main(argv: list[str] | None = None) -> int:
    import agent.service as service

    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--token-interval-s", type=float, default=0.0)
    paced, rest = pre.parse_known_args(argv)
    parser = argparse.ArgumentParser(prog="kvsp agent")
    service.configure_parser(parser)
    args = parser.parse_args(rest)
    made = service.settings_from_args

    def settings_from_args(args: argparse.Namespace) -> service.AgentSettings:
        return dataclasses.replace(made(args), token_interval_s=paced.token_interval_s)

    # `run` builds its settings here; the pause is the one thing the command line cannot set
    service.settings_from_args = settings_from_args
    try:
        return service.run(args)
    except KvspError as e:
        print(f"kvsp agent: {e.detail}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
