import os

# As `kvsp` does (kvsp_moq/cli.py): OpenMP threads wait passively, so that loader threads run
# beside torch's; set before any test module imports torch.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from hypothesis import settings

# Property tests are bounded so the suite stays fast and repeatable in CI.
settings.register_profile("ci", max_examples=200, deadline=None, derandomize=True)
settings.register_profile("dev", max_examples=100, deadline=None)
settings.load_profile("ci" if os.environ.get("CI") else "dev")


import pytest  # noqa: E402  (after the environment and hypothesis settings above)


@pytest.fixture
def relay():
    """A relay of our own on 127.0.0.1 (its own thread and loop), stopped after the test; a
    test module may define its own `relay` instead."""
    from relay.relay import RelaySettings
    from relay.service import BackgroundRelay

    r = BackgroundRelay(RelaySettings()).start()
    try:
        yield r
    finally:
        r.stop()
