"""Trained adapters after the run: merge them into a plain model, or load them for evaluation.

An export never replaces what it was not asked to: its folder must be new or empty, or hold only an earlier
export of the same adapter and base (`forge_export.json` says which); `overwrite` replaces anything else, but
never a folder the export reads from, or a training run's output_dir (its checkpoints and logs). It is written
into a temporary sibling and renamed into place, so a failed export leaves the folder as it was.
"""

from __future__ import annotations

import copy
import errno
import json
import os
import re
import shutil
import warnings
from pathlib import Path
from pickle import UnpicklingError  # only to name torch's refusal; nothing is unpickled here

import torch
from torch import nn
from transformers import PreTrainedTokenizerBase

from forge.logging.logger import TRAINING_LOG_NAME
from forge.model.loading import first_line, load_model, load_tokenizer, prepare_tokenizer
from forge.model.lora import LORA_INSTALL_HINT, is_peft_model, quiet_checkpointing_deprecation
from forge.safe_json import read_json

# --------------------------------------------------------------------------------------------------
# export and evaluation
# --------------------------------------------------------------------------------------------------


# in an exported folder: its adapter, its base, the files the export wrote
EXPORT_RECORD = "forge_export.json"
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".gguf")  # named first in what a refused folder holds


class ExportRefused(ValueError):
    """The export's folder holds something it must not replace; the message names what and what to do."""


def _tokenizer_saved_in(folder: str | os.PathLike) -> bool:
    return (Path(folder) / "tokenizer_config.json").is_file()


def _source_name(source: str | os.PathLike | None) -> str | None:
    """A local folder as its absolute path; a hub id or an alias ('default') as given."""
    if source is None:
        return None
    path = Path(source).expanduser()
    return str(path.resolve()) if path.exists() else str(source)


def check_export_folder(out_dir: str | os.PathLike, adapter: str | os.PathLike | None,
                        base: str | os.PathLike | None, overwrite: bool = False) -> None:
    """Raise ExportRefused unless exporting `adapter` (a folder, or None for a live model) merged into `base`
    may write `out_dir`: new or empty, or only an earlier export of the same adapter and base; with
    `overwrite`, anything but a folder the export reads from (or one holding it)."""
    out = export_folder(out_dir)
    for flag, source in (("--adapter", adapter), ("--base", base)):
        path = Path(source).expanduser() if source is not None else None
        if path is not None and path.exists() and out.exists() and (
                out.resolve() == path.resolve() or out.resolve() in path.resolve().parents):
            holds = "is" if out.resolve() == path.resolve() else "holds"
            raise ExportRefused(
                f"--out {out} {holds} the {flag} folder {path}, which the export reads: it never "
                f"writes there (not with --overwrite either); choose another --out"
            )
    run = training_run(out)
    if run is not None:
        raise ExportRefused(
            f"--out {out} is a training run's output_dir (it holds {run}): an export never replaces "
            f"one, not with --overwrite either, since the run's checkpoints and logs would be lost; "
            f"choose another --out (e.g. {out / 'merged'})"
        )
    if not out.exists() or overwrite:
        return
    if not out.is_dir():
        raise ExportRefused(
            f"--out {out} is a file, not a folder; choose a new or empty folder, or pass --overwrite "
            f"(overwrite=True) to replace it"
        )
    present = _contents(out)
    if not present:
        return
    record = _export_record(out)
    if record is not None:
        extra = sorted(set(present) - set(record.get("files", [])) - {EXPORT_RECORD})
        same = (record.get("adapter"), record.get("base")) == (_source_name(adapter), _source_name(base)) \
            and adapter is not None
        if same and not extra:
            return  # the same export again
        what = (f"the export of --adapter {record.get('adapter')} --base {record.get('base')}"
                + (f", and {_listed(extra)} besides" if extra else ""))
    else:
        what = forge_checkpoint(out) or _listed(present)
    raise ExportRefused(
        f"--out {out} already holds {what}: an export writes only into a new or empty folder, or over "
        f"its own earlier export of the same adapter and base; choose another --out, or pass "
        f"--overwrite (overwrite=True) to replace what is there"
    )


def export_folder(out_dir: str | os.PathLike) -> Path:
    """The folder an export to `out_dir` writes: a link is the folder it leads to (or will lead to), so the
    link stays and leads to the export; a link that leads back to itself is refused (ExportRefused)."""
    out = Path(out_dir).expanduser()
    if not out.is_symlink():
        return out
    try:
        os.stat(out)
    except OSError as error:
        if error.errno == errno.ELOOP:
            raise ExportRefused(
                f"--out {out} is a symlink loop (a link that leads back to itself, never to a folder); "
                f"remove the link or choose another --out"
            ) from None
    return Path(os.path.realpath(out))


def training_run(folder: Path) -> str | None:
    """'checkpoint-3/, final/, training_log.jsonl': what of a training run `folder` holds (checkpoints,
    numbered (`checkpoint-3`, or an earlier Forge's `3`) or final/, that hold COMPLETE; its training log),
    when it is a run's output_dir; else None. An export never replaces one."""
    if not folder.is_dir():
        return None
    held = [f"{child.name}/" for child in folder.iterdir()
            if (re.fullmatch(r"(checkpoint-)?\d+|final", child.name) and (child / "COMPLETE").is_file())]
    held = sorted(held, key=lambda name: (len(name), name)) + (
        [TRAINING_LOG_NAME] if (folder / TRAINING_LOG_NAME).is_file() else [])
    return _listed(held) if held else None


def forge_checkpoint(folder: Path) -> str | None:
    """'a Forge checkpoint (model.safetensors, COMPLETE, ...)' when `folder` is one (it holds COMPLETE), else
    None. An export writes over one only when told to (overwrite), and `save_model` never: its files would no
    longer match the sha256 that COMPLETE records, so it would neither load nor resume."""
    if not (folder / "COMPLETE").is_file():
        return None
    return f"a Forge checkpoint ({_listed(_contents(folder))})"


def _contents(folder: Path) -> list[str]:
    """The names in `folder`, weight files first."""
    return sorted((p.name for p in folder.iterdir()),
                  key=lambda name: (not name.endswith(WEIGHT_SUFFIXES), name))


def _export_record(out: Path) -> dict | None:
    try:
        return read_json(out / EXPORT_RECORD)
    except (OSError, ValueError):  # ValueError: JSONFileError, not the record an export writes
        return None


def _listed(names: list[str], shown: int = 4) -> str:
    more = f" and {len(names) - shown} more" if len(names) > shown else ""
    return ", ".join(names[:shown]) + more


def _load_adapter(base_model: nn.Module, adapter_dir: str | os.PathLike) -> nn.Module:
    """The PeftModel of `adapter_dir` on `base_model`; adapter weights that its adapter_config.json does not
    make (a rank that lies) or a pickle torch refuses are a ValueError naming the folder and the files."""
    try:
        from peft import PeftModel
    except ImportError as error:
        raise ImportError(LORA_INSTALL_HINT) from error
    try:
        with quiet_checkpointing_deprecation(), warnings.catch_warnings():
            # torch's note on an adapter_model.bin's pickle protocol, printed before its own refusal of it
            warnings.filterwarnings("ignore", message="Detected pickle protocol")
            return PeftModel.from_pretrained(base_model, str(adapter_dir))
    except RuntimeError as error:
        mismatch = next((line.strip() for line in str(error).splitlines() if "size mismatch" in line), None)
        if mismatch is None:
            raise
        raise ValueError(
            f"adapter folder {adapter_dir}: its weights ({_adapter_weights(adapter_dir)}) do not fit "
            f"adapter_config.json: {mismatch.replace('torch.Size', '')} The config (its r, "
            f"target_modules) is not the one the adapter was saved with: restore the folder from where "
            f"it came from"
        ) from None
    except UnpicklingError:
        raise ValueError(
            f"adapter folder {adapter_dir}: {_adapter_weights(adapter_dir)} cannot be loaded: it is a "
            f"pickle that holds more than tensors, and unpickling it would run whatever code it names "
            f"(torch refuses it, and Forge never unpickles it); load an adapter saved as "
            f"adapter_model.safetensors"
        ) from None
    except (KeyError, TypeError, AttributeError, IndexError, ValueError) as error:  # peft on bad JSON
        raise ValueError(
            f"adapter folder {adapter_dir}: peft cannot load it ({first_line(error)}); its "
            f"adapter_config.json is damaged or not a LoRA adapter's: restore the folder from where it came "
            f"from, or load another"
        ) from None


def _adapter_weights(adapter_dir: str | os.PathLike) -> str:
    names = sorted(p.name for p in Path(adapter_dir).glob("adapter_model.*"))
    return ", ".join(names) or "its weights"


def merge_and_export(
    adapter_dir_or_model: str | os.PathLike | nn.Module,
    base_name_or_path: str | os.PathLike,
    out_dir: str | os.PathLike,
    *,
    tokenizer: PreTrainedTokenizerBase | None = None,
    overwrite: bool = False,
) -> Path:
    """Fold LoRA adapters into the base weights and save a plain model that transformers loads alone.

    ``adapter_dir_or_model`` is a saved adapter folder (loaded on top of ``base_name_or_path``) or a live
    PeftModel (merged in a copy, so the training model keeps its adapters). The tokenizer is taken from
    ``tokenizer=``, else the adapter folder when one was saved there, else the base. ``out_dir`` is refused
    (ExportRefused) as `check_export_folder` says, before anything loads; merged weights holding NaN/inf are
    refused and nothing is written.
    """
    live = isinstance(adapter_dir_or_model, nn.Module)
    check_export_folder(out_dir, None if live else adapter_dir_or_model, base_name_or_path, overwrite)
    if live:
        if not is_peft_model(adapter_dir_or_model):
            raise TypeError("merge_and_export expects a PeftModel or an adapter folder, got a plain model")
        peft_model = copy.deepcopy(adapter_dir_or_model).to("cpu")
    else:
        adapter_dir = Path(adapter_dir_or_model)
        if not (adapter_dir / "adapter_config.json").is_file():
            raise FileNotFoundError(f"{adapter_dir} has no adapter_config.json; is it a saved LoRA adapter?")
        base_model, base_tokenizer = load_model(base_name_or_path, device="cpu")
        peft_model = _load_adapter(base_model, adapter_dir)
        if tokenizer is None:
            tokenizer = (
                load_tokenizer(adapter_dir)
                if _tokenizer_saved_in(adapter_dir)
                else base_tokenizer
            )
    if tokenizer is None:
        tokenizer = load_tokenizer(base_name_or_path)

    merged = peft_model.merge_and_unload()
    bad = [name for name, tensor in merged.state_dict().items()
           if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all())]
    if bad:
        raise ValueError(
            f"refusing to export: {len(bad)} merged weight tensors hold NaN/inf (e.g. {bad[:3]}); the "
            f"adapter or the base holds them, and a model of them computes nothing"
        )
    return _write_export(export_folder(out_dir), merged, tokenizer,
                         {"adapter": None if live else _source_name(adapter_dir_or_model),
                          "base": None if live else _source_name(base_name_or_path)})


def _write_export(out: Path, merged: nn.Module, tokenizer: PreTrainedTokenizerBase, sources: dict) -> Path:
    """Save into `{out}.tmp-{pid}`, record what was written, then put it in place of `out` (moved aside first
    and deleted once the new one is in place)."""
    staging = out.with_name(f"{out.name}.tmp-{os.getpid()}")
    aside = out.with_name(f"{out.name}.old-{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    try:
        merged.save_pretrained(staging, safe_serialization=True)
        tokenizer.save_pretrained(staging)
        written = sorted(p.name for p in staging.iterdir())
        (staging / EXPORT_RECORD).write_text(json.dumps({**sources, "files": written}, indent=2) + "\n")
        if out.exists():
            os.replace(out, aside)
        os.replace(staging, out)
    except Exception as error:
        if not out.exists() and aside.exists():
            os.replace(aside, out)  # what was there stays
        failed = _write_failed(out, error)
        if failed is None:
            raise
        raise failed from error
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    if aside.exists():
        shutil.rmtree(aside) if aside.is_dir() else aside.unlink()
    return out


def _write_failed(out: Path, error: BaseException) -> OSError | None:
    """An export that could not be written (a full disk, a folder it may not write), in one line naming --out
    and what to do; None for any other failure."""
    causes = [error, error.__cause__, error.__context__]
    if not any(isinstance(e, OSError) or "os error 28" in str(e) for e in causes if e is not None):
        return None
    full = any((isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT)) or "os error 28" in str(e)
               or "No space left on device" in str(e) for e in causes if e is not None)
    reason = ("the disk holding it is full (no space left on device): free space there, or choose an "
              "--out on another disk" if full else
              f"{error} ({type(error).__name__}): make its folder writable, or choose another --out")
    return OSError(f"cannot write the export to {out}: {reason}; {out} is as it was before the export, and "
                   f"no temporary is left")


def load_for_eval(
    model: str | os.PathLike | nn.Module,
    adapter: str | os.PathLike | None = None,
    *,
    tokenizer: PreTrainedTokenizerBase | None = None,
    **load_kwargs,
) -> tuple[nn.Module, PreTrainedTokenizerBase]:
    """A model in eval mode plus its tokenizer, with the LoRA ``adapter`` folder applied when given.

    ``model`` is anything ``load_model`` accepts (``load_kwargs`` go to it), or an already loaded model
    together with ``tokenizer=``.
    """
    if isinstance(model, nn.Module):
        if tokenizer is None:
            raise ValueError("load_for_eval got a loaded model without its tokenizer; pass tokenizer=")
        base_model = model
    else:
        base_model, base_tokenizer = load_model(model, **load_kwargs)
        tokenizer = tokenizer or base_tokenizer
    if adapter is not None:
        base_model = _load_adapter(base_model, adapter)
        if _tokenizer_saved_in(adapter):
            tokenizer = load_tokenizer(adapter)
    return base_model.eval(), prepare_tokenizer(tokenizer)


