"""The thread engine: stages, resizable pools, bounded queues, ordering."""
