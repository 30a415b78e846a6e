"""Every pattern module runs in float64 (differences of 1e-10 of the update are then the package's, not rounding),
and leaves torch's global settings as it found them (``Trainer(deterministic=True)`` turns on
deterministic algorithms for the whole process)."""

import pytest
import torch


@pytest.fixture(autouse=True, scope="module")
def float64():
    dtype, deterministic = torch.get_default_dtype(), torch.are_deterministic_algorithms_enabled()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(dtype)
    torch.use_deterministic_algorithms(deterministic)
