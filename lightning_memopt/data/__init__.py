"""Input pipelines, in plain torch: measure input stalls, diagnose a DataLoader, check that its workers
can start, tune ``num_workers`` by measurement (:class:`~lightning_memopt.DataLoaderMonitor` is the
Lightning adapter), and batch variable-length samples up to a number of padded tokens
(:class:`~lightning_memopt.data.token_batching.MaxTokensBatchSampler`)."""

from lightning_memopt.data.clock import Clock, CudaClock, HostClock, step_clock
from lightning_memopt.data.diagnosis import (
    Diagnosis,
    Fix,
    LoaderSettings,
    batch_cost,
    cores_per_rank,
    diagnose,
)
from lightning_memopt.data.pickling import Unpicklable, check_picklable, find_unpicklable, worker_start_method
from lightning_memopt.data.preserved_rng import preserved_rng
from lightning_memopt.data.stall import StallMeter, StepTime, StepTimes
from lightning_memopt.data.token_batching import MaxTokensBatchSampler, pad_collate, padding_tokens
from lightning_memopt.data.tune import TuneResult, TuneRow, tune_num_workers, worker_candidates

__all__ = [
    "Clock",
    "CudaClock",
    "Diagnosis",
    "Fix",
    "HostClock",
    "LoaderSettings",
    "StallMeter",
    "StepTime",
    "StepTimes",
    "MaxTokensBatchSampler",
    "TuneResult",
    "TuneRow",
    "Unpicklable",
    "batch_cost",
    "check_picklable",
    "cores_per_rank",
    "diagnose",
    "find_unpicklable",
    "pad_collate",
    "padding_tokens",
    "preserved_rng",
    "step_clock",
    "tune_num_workers",
    "worker_candidates",
    "worker_start_method",
]
