import os

from hypothesis import settings

# Property tests are bounded so the suite stays fast and repeatable in CI.
settings.register_profile("ci", max_examples=200, deadline=None, derandomize=True)
settings.register_profile("dev", max_examples=100, deadline=None)
settings.load_profile("ci" if os.environ.get("CI") else "dev")
