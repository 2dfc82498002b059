"""The tuner: what it may set and a rate model (``space``), a search on it and its advice
(``search``), real measurement (``bench``) and the result (``result.Tuning``), each tested alone."""

from .result import Tuning as Tuning
from .tuner import tune as tune
