"""An agent in a process of its own, so that a test can kill it with SIGKILL.

    python -m tests.pc.agent_process '{"model": DIR, "index_url": URL, ...}'

The argument holds `AgentSettings` members (JSON); the agent listens on a free port of
127.0.0.1 and prints one line `{"url": ...}` once it serves, then runs until it is killed or
its standard input closes (so that it never outlives the test that started it). The member
`"pace_layers_s"` (not a setting) slows every prefill pass that publishes live by that much
after each decoder layer, so that a test can kill the agent in the middle of one.
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any

from agent.service import Agent, AgentSettings


def paced(live: Any, seconds: float) -> None:
    """Each live pass sleeps `seconds` after every layer it hands over."""
    original = live.open

    def open_paced(*args: Any, **kw: Any) -> Any:
        p = original(*args, **kw)
        if p is not None:
            on_layer = p.on_layer

            def slow(index: int, k: Any, v: Any) -> None:
                on_layer(index, k, v)
                time.sleep(seconds)
            p.on_layer = slow
        return p

    live.open = open_paced


def main(argv: list[str]) -> int:
    options = json.loads(argv[1])
    options.setdefault("listen", "127.0.0.1:0")
    pace = float(options.pop("pace_layers_s", 0.0))
    agent = Agent(AgentSettings(**options))
    if pace and agent.engine.live is not None:
        paced(agent.engine.live, pace)
    agent.start()
    print(json.dumps({"url": agent.url}), flush=True)
    sys.stdin.read()  # returns when the parent goes away
    agent.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
