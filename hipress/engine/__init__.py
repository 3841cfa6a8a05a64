"""The CaSync engine: negotiation, planning and pipelined execution of task graphs."""

from hipress.engine.engine import STRATEGIES, Engine, Handle

__all__ = ["STRATEGIES", "Engine", "Handle"]
