"""Fetching reads replicas without depending on the holder: `fetch` names a block by
`protocol.records.BlockId` and reads a local store through `fetch.sources.LocalStore`."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from kvsp_moq.holder.store import BlockId
from kvsp_moq.protocol.records import BlockId as RecordsBlockId

ROOT = Path(__file__).resolve().parents[2]


def test_fetch_imports_nothing_of_the_holder_or_the_services() -> None:
    code = ("import sys, kvsp_moq.fetch, kvsp_moq.fetch.sources, kvsp_moq.fetch.fallback, "
            "kvsp_moq.fetch.prefix, kvsp_moq.fetch.http, kvsp_moq.fetch.moqt\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('agent', 'pc', 'relay', 'index')"
            " or m.startswith('kvsp_moq.holder')))")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=ROOT, env=env)
    assert out.stdout.strip() == "[]"


def test_the_holder_store_keys_replicas_by_the_same_block_id() -> None:
    assert BlockId is RecordsBlockId
