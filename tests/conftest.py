import os

# As `kvsp` does (kvsp_moq/cli.py): OpenMP threads wait passively, so that loader threads run
# beside torch's; set before any test module imports torch.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from hypothesis import settings

# Property tests are bounded so the suite stays fast and repeatable in CI.
settings.register_profile("ci", max_examples=200, deadline=None, derandomize=True)
settings.register_profile("dev", max_examples=100, deadline=None)
settings.load_profile("ci" if os.environ.get("CI") else "dev")
