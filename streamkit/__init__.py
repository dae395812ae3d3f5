"""streamkit: stateful, exactly-once stream processing over journals."""

__version__ = "0.1.0"
