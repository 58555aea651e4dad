"""Speculative execution: predict a trajectory's next calls and run them early in forks.

This package holds the pure parts (predictors, the budget, the counters); the
prefix cache (``bunshin.cache``) runs the speculations and lands their results
in its tree.
"""

from .policy import SpeculationPolicy, SpeculationStats
from .predictor import Candidate, ChildStat, FrequencyPredictor, PredictContext, Predictor

__all__ = [
    "Candidate",
    "ChildStat",
    "FrequencyPredictor",
    "PredictContext",
    "Predictor",
    "SpeculationPolicy",
    "SpeculationStats",
]
