"""Will it fit? Predict a training step's memory on fake tensors, and the cheapest change that fits.

The console script ``lightning-memopt plan`` (:mod:`lightning_memopt.planning.cli`, also
``python -m lightning_memopt.planning plan``) and the functions behind it: :func:`plan` (what the script
prints, as a dict), :func:`predict_step` (one step's peak bytes per phase and category, on fake or real
tensors) and :class:`Planner` (the options and the search for the cheapest that fits).

How exact (torch 2.13 CPU, measured by the tests and by comparison with a real CPU step measured with
``MemoryTracker`` by independent code):

=====================================  ============================================================
fp32, GPT example and 10 of 12 zoo     0 bytes, every phase and category
models (ResNet-bottleneck, Swin)       32 bytes of activations (a meta kernel's saved tensor) / 1.9e-5
bf16-mixed (CPU autocast), zoo         within 0.8% (0 for the transformers; convolutions save a few
                                       bytes more for real than their meta kernels say)
bf16-true, GPT example                 0 bytes
tiny HF GPT-2, own or chunked head     0 bytes, every phase and category; its head line as the
                                       shapes say (``predict_step(head=...)``)
FSDP2 over 2 ranks (fully_shard)       0 bytes per rank against a 2-process gloo run
micro-batching (AutoAccumulation)      within 128 bytes per phase of a real Trainer run (Lightning's
                                       own loss scalars), measured by MemoryMonitor
parameters, gradients, optimizer       exact always (they are counted, not estimated)
state
DDP gradient buckets                   modeled: one flat copy of the gradients (``other``)
CPU offload of activations             modeled: the checkpoint planner's bytes
=====================================  ============================================================

CUDA targets. The step runs on fake CPU tensors (the CPU build of torch cannot run fake CUDA tensors), so
the prediction is the tensors' bytes: what ``torch.cuda.memory_allocated`` counts, up to the caching
allocator's rounding of each allocation up to a multiple of 512 bytes (at most 511 bytes per live tensor:
under 1 MiB for the thousand or so tensors of a 7B Llama's step, negligible). Not counted: memory the
allocator reserves but does not hand out (fragmentation; ``memory_reserved - memory_allocated``, typically
a few percent of the peak and more with varying shapes), the CUDA context and kernels (typically
half a GiB or more per process, outside PyTorch's allocator), NCCL's buffers, and cuBLAS/cuDNN workspaces. The default
``headroom=0.1`` keeps 10% of the device free for them; on an 80 GiB card that is 8 GiB. Raise it for
runs with varying sequence lengths.

Known limit: Mixtral's grouped-matmul experts fail on fake tensors in fp32
(torch's meta kernel wants bf16): the error names the module; plan it in bf16 or with
``experts_implementation="eager"``.
"""

from lightning_memopt.planning.build import FakeBuildError
from lightning_memopt.planning.cli import GPUS, main, plan
from lightning_memopt.planning.predict import StepPrediction, predict_step
from lightning_memopt.planning.search import Config, Planner, Prices

__all__ = [
    "GPUS",
    "Config",
    "FakeBuildError",
    "Planner",
    "Prices",
    "StepPrediction",
    "main",
    "plan",
    "predict_step",
]
