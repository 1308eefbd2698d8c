import pytest
import torch


@pytest.fixture(autouse=True)
def one_torch_thread():
    """On the 2-core CI box two OpenMP threads made these small ops ~5-15x slower."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
