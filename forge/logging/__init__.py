"""Training logs: console, JSONL, TensorBoard and W&B behind one `ForgeLogger`."""

from forge.logging.logger import ForgeLogger, NullSink, note

__all__ = ["ForgeLogger", "NullSink", "note"]
