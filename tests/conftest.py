import secrets

import pytest
import torch

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def fresh_seed(request):
    """Fresh random inputs on every run; the seed is printed with a failure to reproduce it."""
    seed = secrets.randbits(31)
    torch.manual_seed(seed)
    print(f"torch seed {seed}")
    return seed
