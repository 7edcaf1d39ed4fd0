"""gyre: elastic reinforcement learning for long-horizon LLM agents behind unmodified harnesses."""

__version__ = "0.1.0"
