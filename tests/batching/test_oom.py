import pytest
import torch

from lightning_memopt.memory.device import is_out_of_memory


@pytest.mark.parametrize(
    "error",
    [
        torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 MiB"),
        RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB (GPU 0; 15.78 GiB total capacity)"),
        RuntimeError("HIP out of memory. Tried to allocate 1.00 GiB"),
        RuntimeError("MPS backend out of memory (MPS allocated: 1.00 GB)"),
        RuntimeError("cuDNN error: CUDNN_STATUS_ALLOC_FAILED"),
        RuntimeError("CUDA error: out of memory\nCUDA kernel errors might be asynchronously reported"),
    ],
)
def test_device_oom_messages(error):
    assert is_out_of_memory(error)


def test_real_cpu_allocator_error():
    with pytest.raises(RuntimeError) as info:
        torch.empty(2**62, dtype=torch.uint8)
    assert is_out_of_memory(info.value)


@pytest.mark.parametrize(
    "error",
    [
        RuntimeError("mat1 and mat2 shapes cannot be multiplied"),
        RuntimeError("my dataset ran out of memory budget"),  # the user's words, not an allocator's
        ValueError("CUDA out of memory"),
        NotImplementedError("CUDA out of memory"),
        KeyboardInterrupt(),
    ],
)
def test_other_errors_are_not_oom(error):
    assert not is_out_of_memory(error)
