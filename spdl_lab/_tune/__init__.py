"""The tuner: a rate model (``model``), a search on it and its advice (``search``), real measurement
(``bench``) and the result (``result.Tuning``), kept apart so each is tested alone."""

from .result import Tuning as Tuning
from .tuner import tune as tune
