"""`kvsp lookup`: the Index Service's answer for a token sequence (KVSP §6.2).

The Block Keys are computed here from the descriptor, a scope key of the keys file and the
tokens, as an agent would, so the answer shows what an agent would find.
"""

from __future__ import annotations

import argparse
import json

from kvsp_moq.errors import KvspError
from kvsp_moq.scope_keys import add_scope_key_options, scope_key_from_args
from kvsp_moq.tools import UsageError, add_common, guarded, read_json_file, say


def configure_parser(p: argparse.ArgumentParser) -> None:
    p.description = (
        "Compute the Block Keys of a token sequence and ask an Index Service which of them "
        "are held; print the number matched, the replicas of each matched key and the tiers "
        "their layers sit in, as one JSON object.")
    p.add_argument("--index", required=True, metavar="URL", help="the Index Service's base URL")
    p.add_argument("--descriptor", required=True, metavar="DESCRIPTOR.json")
    add_scope_key_options(p)
    p.add_argument("--tokens", required=True, metavar="TOKENS.json",
                   help="JSON array of token IDs, or - for stdin")
    p.add_argument("--target", action="append", default=None, metavar="URL",
                   help="instance to estimate fetch and recompute times for (repeatable)")
    add_common(p, block=False)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    return guarded("lookup", lambda: _lookup(args), args)


async def _lookup(args: argparse.Namespace) -> int:
    from kvsp_moq.index_client import IndexClient
    from kvsp_moq.protocol.compat import CompatDescriptor
    from kvsp_moq.protocol.keys import block_keys, scope_id
    from kvsp_moq.protocol.validate import tokens as check_tokens

    try:
        descriptor = CompatDescriptor.from_dict(read_json_file(args.descriptor, "descriptor"))
        scope_key = scope_key_from_args(args, lambda line: say("lookup", line))
        tokens = check_tokens(read_json_file(args.tokens, "tokens file"), "tokens")
    except KvspError as e:
        raise UsageError(e.detail) from None
    compat = descriptor.compat_hex
    scope = scope_id(scope_key).hex()
    keys = [k.hex() for k in block_keys(scope_key, descriptor.compat_id, tokens,
                                         descriptor.block_tokens)]
    if not keys:
        raise UsageError(f"{len(tokens)} tokens make no complete block of "
                         f"{descriptor.block_tokens} tokens")
    async with IndexClient(args.index, token=args.token, timeout=args.timeout) as index:
        result = await index.lookup(scope, compat, keys, args.target)
    out = {
        "compat_id": compat,
        "scope_id": scope,
        "requested": len(keys),
        "matched": result.matched,
        "matched_tokens": result.matched * descriptor.block_tokens,
        "blocks": [{
            "block_key": block.block_key,
            "replicas": [{
                "holder": r.holder,
                "kind": "moqt" if r.is_moqt else "http",
                "tiers": [t.to_json() for t in r.residency],
                "record": r.to_json(),
            } for r in block.replicas],
        } for block in result.blocks],
        "unmatched": keys[result.matched:],
    }
    if result.targets:
        out["targets"] = list(result.targets)
    print(json.dumps(out))
    return 0
