"""Training logs: console, JSONL, TensorBoard and W&B behind one `ForgeLogger`."""

from forge.logging.logger import ForgeLogger, NullSink, install_warning_format, note

__all__ = ["ForgeLogger", "NullSink", "install_warning_format", "note"]
