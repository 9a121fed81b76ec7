"""ForgeLogger: one `log()` call feeds the console, a JSONL file, TensorBoard, W&B and trackio.

Each destination is a small "sink" with the same two methods, `log(metrics, step)` and `close()`.
A sink that is switched off, or whose package is not installed, is a `NullSink`, so the logger never
branches on `if wandb:`. The JSONL files are the source of truth: `forge plot` reads
`training_log.jsonl`, and `truncate_after(step)` trims both files when a run resumes from a
checkpoint, so a resumed run does not write the same step twice.

trackio (https://github.com/gradio-app/trackio, ``pip install forge-rl[trackio]``) is Hugging Face's
local-first tracker with a wandb-like API: without a Space or server configured it writes a SQLite file
under ``TRACKIO_DIR`` (default ``~/.cache/huggingface/trackio``) and needs no network; ``trackio show``
opens the dashboard.
"""

from __future__ import annotations

import json
import logging
import math
import numbers
import os
import sys
import time
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tqdm import tqdm

from forge.safe_json import MAX_JSON_BYTES, JSONFileError, parse_json

if TYPE_CHECKING:
    from collections.abc import Iterator

    from typing_extensions import Self

_console = logging.getLogger("forge")


def is_other_process() -> bool:
    """A process other than the first of a multi-process run (RANK, which torchrun, `accelerate launch` and
    `forge train --nproc` set): its notes and Forge's warnings are the first process's, said once there."""
    return os.environ.get("RANK", "0") not in ("", "0")


def note(message: str) -> None:
    """A one-line note for the user: through the "forge" logger when it is configured, else on stderr; said
    by the first process of a multi-process run only."""
    if is_other_process():
        return
    if _console.hasHandlers() and _console.isEnabledFor(logging.INFO):
        _console.info(message)
    else:
        print(f"[forge] {message}", file=sys.stderr, flush=True)


TRAINING_LOG_NAME = "training_log.jsonl"
SAMPLES_LOG_NAME = "samples.jsonl"


def _json_number(value: Any) -> float | int | None:
    """A metric as a JSON number; NaN and +-inf become None (written as null)."""
    if hasattr(value, "item") and getattr(value, "ndim", None) == 0:  # 0-d torch / numpy scalar
        value = value.item()
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, int):
        return value
    if not isinstance(value, numbers.Real):
        raise TypeError(f"{type(value).__name__} is not a number")
    value = float(value)
    return value if math.isfinite(value) else None


def _numeric_metrics(metrics: dict[str, Any]) -> dict[str, float | int | None]:
    """Keep the metrics that are numbers (python, numpy or 0-d tensors); drop lists, strings, etc."""
    numeric = {}
    for key, value in metrics.items():
        try:
            numeric[key] = _json_number(value)
        except (TypeError, ValueError):
            continue
    return numeric


def _json_safe(value: Any) -> Any:
    """Make a sample field JSON-writable: numbers as in `_json_number`, containers recursively, else str."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, dict):
        return {str(k): _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    try:
        return _json_number(value)
    except (TypeError, ValueError):
        return str(value)


def _format_metric(metrics: dict[str, Any], key: str) -> str:
    value = metrics.get(key)
    if value is None:
        return "n/a"
    try:
        return f"{float(value):.4f}"
    except (TypeError, ValueError):
        return "n/a"


EVAL_HEADLINE = ("strict_accuracy", "soft_accuracy", "task_score", "accuracy", "reward", "n")
"""The eval_* metrics an evaluation's console line shows, when present (else its first six numeric ones)."""

SUMMARY = ("train_runtime", "train_samples_per_second", "train_steps_per_second", "train_loss")
"""The last row of a run (transformers' Trainer's names), which its console line shows alone."""


def format_console_line(metrics: dict[str, Any], step: int, epoch: float) -> str:
    """`step N | epoch E | loss L | reward R | kl K`, with "n/a" for a missing value; a row of evaluation
    metrics only (eval_*) reads `step N | eval | strict_accuracy 0.2500 | ... | n 60` instead, and the run's
    last row `step N | train_runtime 12.3000 | ... | train_loss 0.0001`."""
    numeric = _numeric_metrics(metrics)
    if set(metrics) == set(SUMMARY):
        return " | ".join([f"step {step}", *(f"{key} {_format_value(numeric[key])}" for key in SUMMARY)])
    evaluation = {key.removeprefix("eval_"): value for key, value in numeric.items()
                  if key.startswith("eval_")}
    if evaluation and all(key.startswith("eval_") for key in metrics):
        shown = [key for key in EVAL_HEADLINE if key in evaluation] or list(evaluation)[:6]
        values = (f"{key} {_format_value(evaluation[key])}" for key in shown)
        return " | ".join([f"step {step}", "eval", *values])
    return (
        f"step {step} | epoch {epoch} | loss {_format_metric(metrics, 'loss')} | "
        f"reward {_format_metric(metrics, 'reward')} | kl {_format_metric(metrics, 'kl')}"
    )


def _format_value(value: float | None) -> str:
    return "n/a" if value is None else str(value) if isinstance(value, int) else f"{value:.4f}"


def install_warning_format() -> None:
    """Print the warnings raised in Forge's own modules as one line, `forge: warning: <message>`, without the
    source path and line, by the first process of a multi-process run only (each process meets the same data
    and settings); every other warning keeps the format it had. Safe to call more than once."""
    if getattr(warnings.formatwarning, "forge_format", False):
        return
    previous = warnings.formatwarning

    def formatwarning(message, category, filename, lineno, line=None) -> str:
        if is_forge_source(filename):
            return "" if is_other_process() else f"forge: warning: {message}\n"
        return previous(message, category, filename, lineno, line)

    formatwarning.forge_format = True
    warnings.formatwarning = formatwarning


_FORGE_PACKAGE = Path(__file__).resolve().parents[1]


def is_forge_source(filename: str) -> bool:
    """Whether `filename` (a warning's source file) is one of Forge's own modules."""
    try:
        return Path(filename).resolve().is_relative_to(_FORGE_PACKAGE)
    except (OSError, ValueError):
        return False


def log_rows(path: Path) -> Iterator[tuple[str, dict]]:
    """(line, row) of each row of a JSONL log (training_log.jsonl, samples.jsonl) as Forge writes them: a JSON
    object whose "step", if any, is a number. Any other line is left out with a one-line warning naming the
    file and the line, but for a last line cut short by a crash (no newline: the run died writing it), left
    out silently."""
    with path.open("rb") as f:
        for number, raw in enumerate(iter(lambda: f.readline(MAX_JSON_BYTES + 1), b""), start=1):
            if len(raw) > MAX_JSON_BYTES:  # a line no row makes (a huge damaged file): never read whole
                raise JSONFileError(f"{path}, line {number}", (
                    f"is over {MAX_JSON_BYTES:,} bytes without a line end, no row Forge writes (a damaged "
                    f"file); move {path.name} out of {path.parent} and run again (a run starts a new one)"))
            if not raw.strip():
                continue
            try:
                row = parse_json(raw, f"{path}, line {number}")
            except JSONFileError as error:
                if raw.endswith(b"\n"):  # not a torn last line: say what is dropped
                    warnings.warn(f"{error}: left out (not a row Forge wrote)", stacklevel=2)
                continue
            step = row.get("step")
            if step is not None and (isinstance(step, bool) or not isinstance(step, (int, float))):
                warnings.warn(
                    f"{path}, line {number} has the step {json.dumps(step)[:40]}, not a number: left out "
                    f"(not a row Forge wrote)",
                    stacklevel=2,
                )
                continue
            yield raw.decode("utf-8"), row


def _drop_rows_after(path: Path, step: int) -> None:
    """Rewrite a JSONL file without the rows whose "step" is > `step`, and without any line that is not a row
    (`log_rows`); atomic via temp file + rename."""
    if not path.exists():
        return
    kept = [line if line.endswith("\n") else line + "\n"
            for line, row in log_rows(path) if row.get("step") is None or row["step"] <= step]
    tmp_path = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    with tmp_path.open("w", encoding="utf-8") as f:
        f.writelines(kept)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp_path, path)


# ---------------------------------------------------------------------------------------------------
# Sinks: each has log(metrics, step) and close().
# ---------------------------------------------------------------------------------------------------


class NullSink:
    """A sink that does nothing: stands in for a disabled or unavailable backend."""

    def log(self, metrics: dict[str, Any], step: int) -> None:
        pass

    def close(self) -> None:
        pass


class WandbSink:
    """Weights & Biases run; created only after `import wandb` succeeded."""

    def __init__(self, wandb_module: Any, project: str, run_name: str, config: dict | None) -> None:
        self.wandb = wandb_module
        self.run = wandb_module.init(project=project, name=run_name, config=config or {})

    def log(self, metrics: dict[str, Any], step: int) -> None:
        self.wandb.log(metrics, step=step)

    def close(self) -> None:
        self.wandb.finish()


class TensorBoardSink:
    """`SummaryWriter` scalars under `{output_dir}/tensorboard`."""

    def __init__(self, writer_cls: Any, log_dir: Path) -> None:
        self.writer = writer_cls(log_dir=str(log_dir))

    def log(self, metrics: dict[str, Any], step: int) -> None:
        for key, value in metrics.items():
            if value is not None:
                self.writer.add_scalar(key, value, global_step=step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class TrackioSink:
    """A trackio run; created only after `import trackio` succeeded. Logs locally unless the user pointed
    trackio at a Space or server (``TRACKIO_SPACE_ID`` / ``TRACKIO_SERVER_URL``)."""

    def __init__(self, trackio_module: Any, project: str, run_name: str, config: dict | None) -> None:
        self.run = trackio_module.init(project=project, name=run_name, config=config or {}, embed=False,
                                       auto_log_gpu=False, auto_log_cpu=False)

    def log(self, metrics: dict[str, Any], step: int) -> None:
        self.run.log({key: value for key, value in metrics.items() if value is not None}, step=step)

    def close(self) -> None:
        self.run.finish()


def make_trackio_sink(project: str, run_name: str, config: dict | None) -> TrackioSink | NullSink:
    try:
        import trackio
    except ImportError:
        warnings.warn("use_trackio=True but trackio is not installed (pip install trackio); not logging to "
                      "trackio")
        return NullSink()
    try:
        return TrackioSink(trackio, project, run_name, config)
    except Exception as err:  # noqa: BLE001 -- a tracker failure must not stop training
        warnings.warn(f"trackio.init failed ({err!r}); not logging to trackio")
        return NullSink()


def make_wandb_sink(project: str, run_name: str, config: dict | None) -> WandbSink | NullSink:
    try:
        import wandb
    except ImportError:
        warnings.warn("use_wandb=True but wandb is not installed (pip install wandb); not logging to W&B")
        return NullSink()
    try:
        return WandbSink(wandb, project, run_name, config)
    except Exception as err:  # noqa: BLE001 -- a W&B login or network failure must not stop training
        warnings.warn(f"wandb.init failed ({err!r}); not logging to W&B")
        return NullSink()


def make_tensorboard_sink(log_dir: Path) -> TensorBoardSink | NullSink:
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        warnings.warn(
            "use_tensorboard=True but tensorboard is not installed (pip install tensorboard); "
            "not logging to TensorBoard"
        )
        return NullSink()
    return TensorBoardSink(SummaryWriter, log_dir)


# ---------------------------------------------------------------------------------------------------
# The logger
# ---------------------------------------------------------------------------------------------------


class ForgeLogger:
    """Console + `training_log.jsonl` + `samples.jsonl` + optional TensorBoard / W&B / trackio.

    `enabled=False` (every rank but the main one in a multi-process run) turns every method into a
    no-op, and no file or directory is created. The trackio run is named `wandb_run_name` (one run name
    for both trackers) in project `trackio_project`.
    """

    def __init__(
        self,
        output_dir: str | os.PathLike,
        use_wandb: bool = False,
        wandb_project: str = "forge",
        wandb_run_name: str = "grpo_run",
        use_tensorboard: bool = False,
        config: dict | None = None,
        enabled: bool = True,
        console: bool = True,
        use_trackio: bool = False,
        trackio_project: str = "forge",
    ) -> None:
        self.output_dir = Path(output_dir)
        self.enabled = enabled
        self.console = console and enabled
        self.log_path = self.output_dir / TRAINING_LOG_NAME
        self.samples_path = self.output_dir / SAMPLES_LOG_NAME
        self._log_file = None
        self._samples_file = None
        self.sinks: list[Any] = []
        if not enabled:
            return
        self.output_dir.mkdir(parents=True, exist_ok=True)
        self.sinks = [
            make_wandb_sink(wandb_project, wandb_run_name, config) if use_wandb else NullSink(),
            make_tensorboard_sink(self.output_dir / "tensorboard") if use_tensorboard else NullSink(),
            make_trackio_sink(trackio_project, wandb_run_name, config) if use_trackio else NullSink(),
        ]

    # -- writing ------------------------------------------------------------------------------------

    def log(self, metrics: dict[str, Any], step: int, epoch: float, to_file: bool = True) -> None:
        """Print one console line and append one JSON row (not with to_file=False: the run's summary, which
        training_log.jsonl, a log of the steps and evaluations, leaves out); forward the numeric metrics to
        the sinks."""
        if not self.enabled:
            return
        if self.console:
            tqdm.write(format_console_line(metrics, step, epoch))
        numeric = _numeric_metrics(metrics)
        row = {"step": step, "epoch": _json_number(epoch), "time": time.time(), **numeric}
        if to_file:
            self._log_file = self._append_row(self._log_file, self.log_path, row)
        for sink in self.sinks:
            sink.log(numeric, step)

    def log_samples(self, samples: list[dict[str, Any]], step: int) -> None:
        """Append example completions (prompt, completion, reward, ...) to `samples.jsonl`."""
        if not self.enabled:
            return
        for sample in samples:
            row = {"step": step, **{str(k): _json_safe(v) for k, v in sample.items()}}
            self._samples_file = self._append_row(self._samples_file, self.samples_path, row)

    @staticmethod
    def _append_row(handle, path: Path, row: dict[str, Any]):
        if handle is None or handle.closed:
            handle = path.open("a", encoding="utf-8")
        handle.write(json.dumps(row, allow_nan=False) + "\n")
        handle.flush()
        return handle

    # -- resume -------------------------------------------------------------------------------------

    def truncate_after(self, step: int) -> None:
        """Drop rows logged after `step` (they belong to the run that crashed after the checkpoint)."""
        if not self.enabled:
            return
        self._close_files()
        _drop_rows_after(self.log_path, step)
        _drop_rows_after(self.samples_path, step)

    def last_logged_step(self) -> int | None:
        """The highest step in `training_log.jsonl`, or None when nothing was logged yet."""
        if not self.enabled or not self.log_path.exists():
            return None
        steps = [row["step"] for _, row in log_rows(self.log_path) if isinstance(row.get("step"), int)]
        return max(steps, default=None)

    # -- shutdown -----------------------------------------------------------------------------------

    def _close_files(self) -> None:
        for handle in (self._log_file, self._samples_file):
            if handle is not None:
                handle.close()
        self._log_file = self._samples_file = None

    def close(self) -> None:
        if not self.enabled:
            return
        self._close_files()
        for sink in self.sinks:
            sink.close()
        self.sinks = []

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()
