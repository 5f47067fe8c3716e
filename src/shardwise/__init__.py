"""shardwise: training transformer language models across many devices."""

__version__ = "0.1.0"
