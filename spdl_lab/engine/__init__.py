"""The thread engine: stages, resizable pools, bounded queues, ordering."""

from .engine import Engine, EngineReading

__all__ = ["Engine", "EngineReading"]
