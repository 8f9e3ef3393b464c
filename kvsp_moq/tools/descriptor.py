"""`kvsp descriptor`: the Compatibility Descriptor (KVSP §4.1) an agent uses for a model.

A descriptor names the model by the digests of its weight and tokenizer files, so writing one
by hand is error-prone. This finds the model directory the way `kvsp agent` does (`agent.service.
model_directory`, which makes `tiny` once under --data or the cache folder) and computes the
descriptor with `kvsp_moq.model_descriptor`, as the agent and the vLLM connector do, without
loading the weights; so its Compatibility ID is the agent's by construction and
`kvsp compat-id`, `kvsp block-keys` and `kvsp lookup --descriptor` agree with the fleet.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from kvsp_moq.arguments import positive_int
from kvsp_moq.errors import KvspError
from kvsp_moq.model_descriptor import DEFAULT_BLOCK_TOKENS, DTYPES, model_descriptor
from kvsp_moq.tools import EXIT_USAGE, UsageError, say


def configure_parser(p: argparse.ArgumentParser) -> None:
    p.description = ("Print the Compatibility Descriptor (KVSP §4.1, JSON) that `kvsp agent "
                     "--model MODEL` uses, or with --compat-id its Compatibility ID. Give the "
                     "agent's --data, --dtype and --block-tokens to get its exact descriptor.")
    p.add_argument("model", nargs="?", default="tiny", metavar="tiny|DIR",
                   help="'tiny' (the built-in test model, made once) or a local model directory "
                        "(default %(default)s)")
    p.add_argument("--block-tokens", type=positive_int, default=DEFAULT_BLOCK_TOKENS, metavar="B",
                   help="tokens per KV block, as the agents' --block-tokens (default %(default)s)")
    p.add_argument("--dtype", default="float32", choices=DTYPES,
                   help="as the agents' --dtype: the KV blocks' element type (default %(default)s)")
    p.add_argument("--data", metavar="DIR",
                   help="as the agent's --data: where 'tiny' is made (default: ~/.cache/kvsp-moq)")
    p.add_argument("--out", metavar="FILE", help="write the descriptor to FILE instead")
    p.add_argument("--force", action="store_true", help="replace an existing --out file")
    p.add_argument("--compat-id", action="store_true",
                   help="print only the Compatibility ID (lowercase hex)")
    p.set_defaults(func=run)


def _quiet_transformers() -> None:
    """No progress bars: stdout is the descriptor, stderr is for refusals."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()


def agent_descriptor(model: str, *, block_tokens: int = DEFAULT_BLOCK_TOKENS,
                     dtype: str = "float32", data_dir: str | None = None) -> dict:
    """The descriptor an agent with these settings computes (its ModelAdapter calls the same
    `model_descriptor`); the weights are hashed, not loaded."""
    from agent.settings import AgentSettings, model_directory  # the agent's own model lookup

    settings = AgentSettings(model=model, dtype=dtype, data_dir=data_dir, block_tokens=block_tokens)
    return model_descriptor(model_directory(settings), dtype=dtype, block_tokens=block_tokens)


def run(args: argparse.Namespace) -> int:
    """Print or write the descriptor; a refusal is one line on stderr and exit status 2."""
    from kvsp_moq.protocol.compat import CompatDescriptor

    try:
        if args.out and Path(args.out).exists() and not args.force:
            raise UsageError(f"{args.out} exists; --force replaces it")
        _quiet_transformers()
        try:
            descriptor = agent_descriptor(args.model, block_tokens=args.block_tokens,
                                          dtype=args.dtype, data_dir=args.data)
        except (OSError, ValueError) as e:  # no such directory, not a model, unsupported type
            detail = " ".join(str(e).split())  # one line, whatever the loader said
            raise UsageError(f"cannot load model {args.model}: {detail}") from None
        compat = CompatDescriptor.from_dict(descriptor).compat_hex
        text = compat if args.compat_id else json.dumps(descriptor, indent=2)
        if args.out:
            try:
                Path(args.out).write_text(text + "\n", encoding="utf-8")
            except OSError as e:
                raise UsageError(f"cannot write {args.out}: {e.strerror or e}") from None
        else:
            print(text)
    except UsageError as e:
        say("descriptor", str(e))
        return EXIT_USAGE
    except KvspError as e:
        say("descriptor", e.detail)
        return EXIT_USAGE
    except BrokenPipeError:
        return 0
    return 0
