"""The `kvsp` command line.

Every refusal exits with status 2 and one line on stderr saying what is wrong; a traceback is a
bug. Subcommands that run services import them lazily, so `kvsp compat-id` starts fast.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any, Callable, Sequence

from kvsp_moq import __version__
from kvsp_moq.allocator import tune_allocator
from kvsp_moq.errors import KvspError, SettingError, UsageError
from kvsp_moq.scope_keys import add_scope_key_options

EXIT_USAGE = 2

#: when the command started (its imports but the first few included), for the totals commands
#: report beside the time of the work itself
STARTED = time.perf_counter()

#: OpenMP threads (torch on the CPU) spin between parallel regions by default. The agent loads
#: KV layers on other threads while the model computes, and spinning threads starve them: on
#: two cores a pipelined load measured several times slower than load-then-compute. Passive
#: waiting must be chosen before the OpenMP runtime loads, i.e. before torch is imported.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")



def _read_json(path: str, what: str) -> Any:
    try:
        text = sys.stdin.read() if path == "-" else Path(path).read_text(encoding="utf-8")
    except OSError as e:
        raise UsageError(f"cannot read {what} {path}: {e.strerror or e}") from None
    except UnicodeDecodeError:
        raise UsageError(f"{what} {path} is not UTF-8 text") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise UsageError(f"{what} {path} is not valid JSON: {e.msg} at line {e.lineno}") from None


def _read_bytes(path: str, what: str) -> bytes:
    try:
        return sys.stdin.buffer.read() if path == "-" else Path(path).read_bytes()
    except OSError as e:
        raise UsageError(f"cannot read {what} {path}: {e.strerror or e}") from None


def _descriptor(path: str):
    from kvsp_moq.protocol.compat import CompatDescriptor

    return CompatDescriptor.from_dict(_read_json(path, "descriptor"))


def cmd_compat_id(args: argparse.Namespace) -> int:
    print(_descriptor(args.descriptor).compat_hex)
    return 0


def cmd_block_keys(args: argparse.Namespace) -> int:
    from kvsp_moq.protocol.keys import block_keys, scope_id
    from kvsp_moq.protocol.validate import tokens as check_tokens
    from kvsp_moq.scope_keys import scope_key_from_args

    descriptor = _descriptor(args.descriptor)
    scope_key = scope_key_from_args(
        args, lambda line: print(f"kvsp block-keys: {line}", file=sys.stderr))
    tokens = check_tokens(_read_json(args.tokens, "tokens file"), "tokens")
    keys = block_keys(scope_key, descriptor.compat_id, tokens, descriptor.block_tokens)
    print(json.dumps({
        "compat_id": descriptor.compat_hex,
        "scope_id": scope_id(scope_key).hex(),
        "block_keys": [k.hex() for k in keys],
    }))
    return 0


def cmd_inspect(args: argparse.Namespace) -> int:
    from kvsp_moq.protocol.container import Container

    data = _read_bytes(args.file, "container")
    try:
        summary = Container(data).describe()
    except KvspError as e:
        raise UsageError(f"{args.file}: {e.detail}") from None
    print(json.dumps(summary, indent=None if args.compact else 2))
    return 0


#: The packages of the `agent` extra: torch and the model's tokenizer and weights.
AGENT_EXTRA = ("torch", "transformers", "tokenizers", "safetensors")
AGENT_EXTRA_HINT = "pip install 'kvsp-moq[agent]'"
#: Benchmarks that run a model, here or in the agents they start.
MODEL_BENCHMARKS = ("fleet", "ttft", "live")


def missing_agent_extra() -> str | None:
    """The first package of the agent extra that cannot be imported, or None."""
    import importlib.util

    for name in AGENT_EXTRA:
        try:
            if importlib.util.find_spec(name) is None:
                return name
        except (ImportError, ValueError):  # ValueError: a module set to None in sys.modules
            return name
    return None


def _needs_agent_extra(what: str) -> None:
    """UsageError naming the extra to install, before anything starts, when it is missing (a
    fleet's agents would otherwise each end in a traceback)."""
    missing = missing_agent_extra()
    if missing is not None:
        raise UsageError(f"{what} needs the agent extra ({missing} is not installed): "
                         f"{AGENT_EXTRA_HINT}")


#: Benchmarks that take --engine and --datagram-size (a matrix of cells).
MATRIX_BENCHMARKS = ("moqt",)
#: Benchmarks whose every process speaks MOQT at one datagram size (--datagram-size).
ONE_SIZE_BENCHMARKS = ("live",)


def cmd_bench(args: argparse.Namespace) -> int:
    """Run one benchmark. For moqt, --engine (else --quic-engine, else both engines) and
    --datagram-size pick the matrix's cells; elsewhere they are refused, not ignored."""
    if args.overhead_only and args.target != "gateway":
        raise UsageError("--overhead-only: only for bench gateway")
    if args.target in MODEL_BENCHMARKS or args.overhead_only:
        _needs_agent_extra(f"bench {args.target}")
    from kvsp_moq.bench import run_bench

    options: dict[str, Any] = {}
    if args.target in MATRIX_BENCHMARKS:
        options = {"engines": args.engine or args.quic_engine, "datagram_sizes": args.datagram_size}
    elif args.target in ONE_SIZE_BENCHMARKS:
        options = {"datagram_size": args.datagram_size}
        if args.engine:
            raise UsageError(f"--engine: only for bench {', '.join(MATRIX_BENCHMARKS)}")
    else:
        given = [o for o, v in (("--engine", args.engine), ("--datagram-size", args.datagram_size)) if v]
        if given:
            raise UsageError(f"{' and '.join(given)}: only for bench "
                             f"{', '.join(MATRIX_BENCHMARKS + ONE_SIZE_BENCHMARKS)}")
    if args.pcs is not None:
        if args.target != "route":
            raise UsageError("--pcs: only for bench route")
        if not 1 <= args.pcs <= 64:
            raise UsageError("--pcs must be between 1 and 64")
        options["pcs"] = args.pcs
    target = "gateway_overhead" if args.overhead_only else args.target
    result = run_bench(target, quick=args.quick, **options)
    print(json.dumps(result, indent=2))
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    if args.core_only:
        from kvsp_moq.demo.walkthrough import run_core_walkthrough

        run_core_walkthrough(as_json=args.json)
        return 0
    from kvsp_moq.demo.run import run_demo

    return run_demo(as_json=args.json, serve=args.serve, report_dir=args.report_dir)


#: Service subcommands: name -> (module with configure_parser/run, one-line help).
SERVICES: dict[str, tuple[str, str]] = {
    "index": ("index.service", "run the Index Service and Placement Controller (HTTP)"),
    "holder": ("kvsp_moq.holder.service", "run an HTTP block holder with tiers and leases"),
    "relay": ("relay.service", "run a MOQT relay with an object cache"),
    "agent": ("agent.service", "run an inference instance (model, KV pool, holder)"),
    "gateway": ("kvsp_moq.gateway.service",
                "serve OpenAI's API in front of the PC (completions, chat, streaming)"),
    "get": ("kvsp_moq.tools.get", "fetch a block from a holder or a relay, verified"),
    "subscribe": ("kvsp_moq.tools.subscribe", "print the objects of a MOQT track as they arrive"),
    "put": ("kvsp_moq.tools.put", "store a block container at a holder"),
    "lookup": ("kvsp_moq.tools.lookup", "ask the Index Service which blocks of tokens are held"),
    "keys": ("kvsp_moq.tools.keys", "make bearer tokens, principals entries and scope keys"),
    "descriptor": ("kvsp_moq.tools.descriptor",
                   "print the Compatibility Descriptor an agent uses for a model"),
    "fleet": ("kvsp_moq.fleet.command",
              "build a fleet on one machine: network namespaces, shaped links, servers (root)"),
}

#: Commands that speak MOQT, and so take --quic-engine.
MOQT_COMMANDS = ("relay", "holder", "agent", "get", "subscribe", "bench", "demo")
ENGINE_HELP = ("QUIC engine for MOQT: qh3 (native core, GSO/GRO) or aioquic (pure Python); "
               "default: $KVSP_QUIC_ENGINE, else qh3. Peers need not use the same one")


#: Services that take their QUIC settings from their options, as settings (`quic_settings`).
QUIC_SERVICES = ("relay", "holder", "agent")
DATAGRAM_HELP = ("UDP payload size of MOQT in bytes (1200-65507); default: "
                 "$KVSP_MOQT_DATAGRAM_SIZE, else by destination: 60,000 towards loopback, 1,452 "
                 "otherwise (9000 suits a jumbo-frame path)")


def _add_engine_option(p: argparse.ArgumentParser, *, datagram: bool = False) -> None:
    p.add_argument("--quic-engine", metavar="ENGINE", help=ENGINE_HELP)
    if datagram:
        p.add_argument("--datagram-size", metavar="BYTES", help=DATAGRAM_HELP)


def _apply_engine_option(args: argparse.Namespace) -> None:
    """Make --quic-engine the process's default (child processes inherit it); an unknown
    engine, or one whose package is missing, is a SettingError (one line, exit 2). The
    services take theirs as settings instead and leave the environment alone."""
    if args.command not in MOQT_COMMANDS or args.command in QUIC_SERVICES:
        return
    from kvsp_moq.moqt.quic.settings import ENGINE_ENV, check_engine, default_engine

    if getattr(args, "quic_engine", None):
        os.environ[ENGINE_ENV] = check_engine(args.quic_engine)
    else:
        default_engine()


#: Benchmarks: name -> module under kvsp_moq.bench.
BENCHMARKS = ("core", "http", "moqt", "loss", "ttft", "route", "load", "vllm", "fleet", "live",
              "gateway")


def _add_services(sub: argparse._SubParsersAction, argv: Sequence[str]) -> None:
    """Add service subcommands; a service's module is imported only when it is invoked."""
    import importlib

    for name, (module, summary) in SERVICES.items():
        p = sub.add_parser(name, help=summary, description=summary)
        wanted = name in argv[:1] or (len(argv) > 1 and argv[0] == "help" and argv[1] == name)
        if not wanted:
            p.set_defaults(func=None, service=module)
            continue
        mod = importlib.import_module(module)
        mod.configure_parser(p)
        if name in MOQT_COMMANDS:
            _add_engine_option(p, datagram=name in QUIC_SERVICES)
        p.set_defaults(func=mod.run)


def build_parser(argv: Sequence[str] = ()) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvsp",
        description=(
            "KV Cache Storage Protocol (KVSP) over Media over QUIC Transport: protocol tools, "
            "services and benchmarks."
        ),
    )
    parser.add_argument("--version", action="version", version=f"kvsp-moq {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    p = sub.add_parser(
        "compat-id", help="print the Compatibility ID of a descriptor",
        description="Validate a Compatibility Descriptor (KVSP §4.1) and print its "
                    "Compatibility ID as lowercase hex.",
    )
    p.add_argument("descriptor", metavar="DESCRIPTOR.json", help="descriptor file, or - for stdin")
    p.set_defaults(func=cmd_compat_id)

    p = sub.add_parser(
        "block-keys", help="compute the Block Keys of a token sequence",
        description="Compute the Block Keys (KVSP §4.2) of every complete block of a token "
                    "sequence and print {compat_id, scope_id, block_keys} as one JSON object.",
    )
    p.add_argument("--descriptor", required=True, metavar="DESCRIPTOR.json")
    add_scope_key_options(p)
    p.add_argument("--tokens", required=True, metavar="TOKENS.json",
                   help="JSON array of integers in [0, 2^32), or - for stdin")
    p.set_defaults(func=cmd_block_keys)

    p = sub.add_parser(
        "inspect", help="describe a KVB1 block container",
        description="Parse a KV Block Container (KVSP §4.3) and print its header, layer "
                    "lengths and digests as JSON.",
    )
    p.add_argument("file", metavar="FILE", help="container file, or - for stdin")
    p.add_argument("--compact", action="store_true", help="print on one line")
    p.set_defaults(func=cmd_inspect)

    p = sub.add_parser(
        "bench", help="run a benchmark and print JSON",
        description="Run a benchmark and print its figures as JSON, with ratios against a "
                    "baseline measured in the same run.",
    )
    p.add_argument("target", choices=BENCHMARKS, help="what to measure")
    p.add_argument("--quick", action="store_true", help="smaller inputs, for a smoke run")
    p.add_argument("--engine", metavar="ENGINE[,ENGINE...]",
                   help="moqt: QUIC engines of the matrix (default: --quic-engine if given, "
                        "else aioquic,qh3)")
    p.add_argument("--datagram-size", metavar="SIZE[,SIZE...]",
                   help="moqt: datagram sizes of the matrix, in bytes or 'loopback' (60,000) "
                        "(default: $KVSP_MOQT_DATAGRAM_SIZE if set, else 1452,9000,loopback); "
                        "live: the one size every process uses (default: as for a service)")
    p.add_argument("--pcs", type=int, metavar="N",
                   help="route: also N PC processes sharing their state in a Redis the benchmark "
                        "starts (redis-server on PATH), with the total for 1..N of them")
    p.add_argument("--overhead-only", action="store_true",
                   help="gateway: only the gateway's own time per request (tokenization and the "
                        "PC's route), with engines that answer at once: no vLLM needed")
    _add_engine_option(p)
    p.set_defaults(func=cmd_bench)
    p = sub.add_parser(
        "demo", help="show KVSP at work on this machine",
        description="Run the system on 127.0.0.1 and show a shared prompt computed once and "
                    "reused; every figure printed is measured in the run.",
    )
    p.add_argument("--json", action="store_true", help="print a machine-readable report")
    p.add_argument("--serve", action="store_true",
                   help="start the system, print its URLs and tokens, and keep it running")
    p.add_argument("--report-dir", metavar="DIR",
                   help="where to write the report (default: a new temporary folder)")
    p.add_argument("--core-only", action="store_true",
                   help="only show the protocol core (IDs, keys, a container); starts nothing")
    _add_engine_option(p)
    p.set_defaults(func=cmd_demo)
    _add_services(sub, list(argv))
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(argv)
    args = parser.parse_args(argv)
    tune_allocator()
    # httpx logs every request at INFO: a status report a second, a lease per block load.
    logging.getLogger("httpx").setLevel(logging.WARNING)
    func: Callable[[argparse.Namespace], int] = args.func
    try:
        _apply_engine_option(args)
        return func(args)
    except UsageError as e:
        print(f"kvsp {args.command}: {e}", file=sys.stderr)
    except KvspError as e:
        print(f"kvsp {args.command}: {e.detail}", file=sys.stderr)
    except SettingError as e:
        print(f"kvsp {args.command}: {e}", file=sys.stderr)
    except ModuleNotFoundError as e:
        if (e.name or "").partition(".")[0] not in AGENT_EXTRA:
            raise
        print(f"kvsp {args.command}: needs the agent extra ({e.name} is not installed): "
              f"{AGENT_EXTRA_HINT}", file=sys.stderr)
    except BrokenPipeError:  # e.g. `kvsp ... | head`: the reader left; not an error of ours
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except KeyboardInterrupt:
        print(f"kvsp {args.command}: interrupted", file=sys.stderr)
        return 130
    return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
