"""Will it fit? Predict a training step's memory on fake tensors, and the cheapest change that fits.

The console script ``lightning-memopt plan`` (:mod:`lightning_memopt.planning.cli`) and the functions
behind it: :func:`plan` (what the script prints, as a dict), :func:`predict_step` (one step's peak bytes
per phase and category, on fake or real tensors) and :class:`Planner` (the options and the search).
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
