"""The CaSync engine: negotiation, planning and pipelined execution of task graphs."""

from hipress.engine.engine import POLICY, STRATEGIES, Engine, Handle

__all__ = ["POLICY", "STRATEGIES", "Engine", "Handle"]
