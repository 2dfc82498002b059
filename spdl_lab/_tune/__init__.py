"""The tuner: a rate model (``model``), a search on it (``search``), real measurement (``bench``),
the advice (``advice``) and the result (``result.Tuning``), kept apart so each is tested alone."""

from .result import Tuning
from .tuner import tune

__all__ = ["Tuning", "tune"]
