import os

import pytest
import torch
from hypothesis import settings

# Without a GPU, Triton kernels run in its interpreter; it must be chosen before triton loads.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Example counts of the tests that take them from the profile (the input fuzz tests; others
# set their own): "ci" by default, "stress" (10x) with HYPOTHESIS_PROFILE=stress.
FUZZ_EXAMPLES = 40
settings.register_profile("ci", max_examples=FUZZ_EXAMPLES, deadline=None)
settings.register_profile("stress", max_examples=10 * FUZZ_EXAMPLES, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
