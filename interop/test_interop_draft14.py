"""Interop with aiomoqt 0.13.3 over draft-14 raw QUIC (ALPN "moq-00"): aiomoqt's conformance
client, pinned to draft-14 (`--draft 14`, a strict pin), against our relay, which accepts
draft-14 clients beside draft-18 ones. Every default case, then `fetch` and `join`, must be
`ok`, none skipped, none accepted only under a COMPAT tolerance.

Two default cases test messages that draft-14 lacks, and the client itself reports them
`ok # SKIP` once draft-14 is negotiated, whatever the relay does: `rendezvous-timeout`
(RENDEZVOUS_TIMEOUT is draft-18) and `subscribe-namespace-lifecycle` (NAMESPACE is
draft-16). They are checked to be skipped for exactly that reason and no other; the draft-18
suite (test_interop.py) runs them for real.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from .conftest import PEER_BIN, our_relay
from .test_interop import JOIN_RUNS, STANDARD_CASES, assert_all_ok, parse_tap

DRAFT = "14"
#: default cases that the client skips on draft-14, with the reason it gives
NOT_IN_DRAFT14 = {
    "rendezvous-timeout": "RENDEZVOUS_TIMEOUT is draft-18; negotiated draft-14",
    "subscribe-namespace-lifecycle": "NAMESPACE is draft-16; negotiated draft-14",
}
DRAFT14_CASES = [case for case in STANDARD_CASES if case not in NOT_IN_DRAFT14]


async def run_interop_client(url: str, case: str | None, log: Path, draft: str = DRAFT) -> str:
    """interop.test_interop.run_interop_client with the draft as an argument."""
    argv = [str(PEER_BIN / "moq-interop-client"), "--draft", draft, "--tls-disable-verify", "-r", url]
    if case:
        argv += ["-t", case]
    with open(log, "ab") as err:
        proc = await asyncio.create_subprocess_exec(*argv, stdout=asyncio.subprocess.PIPE, stderr=err)
        try:
            out, _ = await asyncio.wait_for(proc.communicate(), 180)
        except asyncio.TimeoutError:
            proc.kill()
            await proc.wait()
            raise AssertionError(f"moq-interop-client --draft {draft} {case or ''} did not finish in time") from None
    return out.decode(errors="replace")


def assert_draft14(tap: str) -> None:
    """Every session of the run negotiated draft-14 (ALPN "moq-00"), none draft-18."""
    report = "\n" + tap
    assert 'alpn: "moq-00"' in tap and 'moqt_version: "moqt-14"' in tap, report
    assert 'alpn: "moqt-' not in tap and "moqt-18" not in tap, report


def assert_default_run_ok(tap: str) -> None:
    """All default cases ran in order: the draft-14 ones `ok` with no directive, the two
    draft-18/16-only ones skipped by the client for that reason alone."""
    plan, results = parse_tap(tap)
    report = "\n" + tap
    assert plan == len(STANDARD_CASES) == len(results), report
    assert [name for _, name, _ in results] == STANDARD_CASES, report
    for ok, name, directive in results:
        assert ok, f"{name} failed:{report}"
        if name in NOT_IN_DRAFT14:
            assert directive == f"# SKIP {NOT_IN_DRAFT14[name]}", f"{name}: unexpected outcome:{report}"
        else:
            assert directive == "", f"{name} passed only with {directive!r}:{report}"
    assert "compat: true" not in tap, report
    assert_draft14(tap)


@pytest.mark.matrix("aiomoqt interop client: 12 default cases, fetch", "our relay", draft="14")
async def test_aiomoqt_draft14_conformance_client_against_our_relay(tmp_path):
    async with our_relay(tmp_path) as url:
        log = tmp_path / "interop-client.log"
        assert_default_run_ok(await run_interop_client(url, None, log))
        for case in DRAFT14_CASES + ["fetch"]:  # one by one too: none depends on an earlier case
            tap = await run_interop_client(url, case, log)
            assert_all_ok(tap, [case])
            assert_draft14(tap)


@pytest.mark.matrix("aiomoqt interop client: join (from 20: FILL)", "our relay", draft="14")
async def test_aiomoqt_draft14_conformance_client_join_against_our_relay(tmp_path):
    """SUBSCRIBE and its joining FETCH back to back, as in the draft-18 suite; repeated, since
    the order in which the two arrive varies."""
    async with our_relay(tmp_path) as url:
        for _ in range(JOIN_RUNS):
            tap = await run_interop_client(url, "join", tmp_path / "interop-client.log")
            assert_all_ok(tap, ["join"])
            assert_draft14(tap)
