"""Which target and drafter the CLI and the demo run, and loading them with one-line errors.

The embedded default target is ``specla-gdn-tiny`` and its aligned drafter ``specla-gdn-tiny-drafter``, both under
``$SPECLA_HOME`` (default: the ``checkpoints/`` folder of this repository, which an editable install points into).
Without the aligned drafter, or for a target of the user's choosing without ``--drafter``, the drafter is the
target's own first block ("layer-skip"): embeddings, block 1, final norm and LM head as a one-block GDN, which needs
no training and always fits the target.
"""
from __future__ import annotations

import copy
import os
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from specla_hf.models.fla_gdn import check_gdn_model
from specla_hf.models.qwen3_5 import text_decoder
from specla_hf.generation import draft_options, make_drafter

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_TARGET = "specla-gdn-tiny"
DEFAULT_DRAFTER = "specla-gdn-tiny-drafter"
LAYER_SKIP = "layer-skip"          # --drafter value that asks for the layer-skip drafter explicitly
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")


class ModelError(Exception):
    """A model cannot be loaded, or does not fit the target; the message is one line meant for the user."""


@dataclass
class Models:
    target: torch.nn.Module            # fla GatedDeltaNetForCausalLM
    drafter: torch.nn.Module           # a GDN draft model or a specla_hf SpecLADrafter
    tokenizer: object                  # the target's tokenizer
    target_name: str
    drafter_name: str                  # how the drafter came about, shown in stats lines and the demo


def checkpoint_home() -> Path:
    return Path(os.environ["SPECLA_HOME"]) if os.environ.get("SPECLA_HOME") else REPO_ROOT / "checkpoints"


def resolve_device(device: str) -> torch.device:
    try:
        dev = torch.device(device)
    except RuntimeError as e:
        raise ModelError(f"--device {device}: not a device ({e})") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ModelError(f"--device {device}: no CUDA GPU is visible to torch; run with --device cpu")
    if dev.type == "cuda" and dev.index is not None and dev.index >= torch.cuda.device_count():
        raise ModelError(f"--device {device}: only {torch.cuda.device_count()} CUDA device(s) visible")
    if dev.type not in ("cpu", "cuda"):
        raise ModelError(f"--device {device}: SpecLA runs on cpu or cuda")
    return dev


def load_models(target: str | None = None, drafter: str | None = None, device: str = "cpu",
                dtype: str = "auto") -> Models:
    """Load target, tokenizer and drafter (see the module docstring for the defaults) and check that they fit.

    ``target`` / ``drafter`` are local folders or Hugging Face Hub ids; ``drafter="layer-skip"`` builds the
    layer-skip drafter from the target. ``dtype="auto"`` is float32 on the CPU and bfloat16 on CUDA.
    """
    dev = resolve_device(device)
    torch_dtype = DTYPES[dtype] if dtype != "auto" else (torch.bfloat16 if dev.type == "cuda" else torch.float32)
    home = checkpoint_home()
    if target is None:
        target_loc, target_name = _locate(str(home / DEFAULT_TARGET), "default target", default=True), DEFAULT_TARGET
    else:
        target_loc, target_name = _locate(target, "target"), target

    target_model = _load(target_loc, "target", torch_dtype, dev)
    try:
        check_gdn_model(target_model)
    except (TypeError, NotImplementedError) as e:
        raise ModelError(f"target {target_name}: {e}") from None
    try:
        tokenizer = AutoTokenizer.from_pretrained(target_loc)
    except (OSError, ValueError) as e:
        raise ModelError(f"target {target_name} has no usable tokenizer: {_first_line(e)}") from None

    aligned = home / DEFAULT_DRAFTER
    if drafter is None and target is None and (aligned / "config.json").is_file():
        drafter = str(aligned)
    if drafter is None or drafter == LAYER_SKIP:
        drafter_model = layer_skip_drafter(target_model)
        drafter_name = f"layer-skip (target block 1 of {target_model.config.num_hidden_layers})"
    else:
        drafter_model = _load(_locate(drafter, "drafter"), "drafter", torch_dtype, dev)
        kind = "aligned drafter" if getattr(drafter_model, "is_specla_drafter", False) else "GDN draft model"
        drafter_name = f"{kind} {drafter}"
    try:
        make_drafter(target_model, drafter_model, draft_options(tree=True))
    except (TypeError, ValueError, NotImplementedError) as e:
        raise ModelError(f"drafter {drafter or LAYER_SKIP}: {e}") from None
    return Models(target_model, drafter_model, tokenizer, target_name, drafter_name)


def layer_skip_drafter(target: torch.nn.Module) -> torch.nn.Module:
    """The target's embeddings, first block, final norm and LM head as a one-block model of the target's class (an
    fla GDN, or a hybrid whose first block is a GDN layer), weights and buffers shared, not copied."""
    cfg = copy.deepcopy(target.config)
    text = cfg.get_text_config()          # a vision-language hybrid keeps its decoder's shape in its text config
    text.num_hidden_layers = 1
    if getattr(text, "layer_types", None):
        text.layer_types = text.layer_types[:1]
    with torch.device("meta"):                     # no random init: every weight comes from the target
        drafter = type(target)(cfg)
    # the decoder's blocks past the first are dropped (a vision tower's blocks are other modules)
    names = {module: name for name, module in target.named_modules()}
    blocks = names[text_decoder(target).layers] + "."
    keep = {k: v for k, v in target.state_dict().items() if not k.startswith(blocks) or k.startswith(blocks + "0.")}
    drafter.load_state_dict(keep, strict=True, assign=True)
    # buffers left out of the state dict (a rotary embedding's inverse frequencies) are still on the meta device
    for name, buffer in drafter.named_buffers():
        if buffer.is_meta:
            module, _, attr = name.rpartition(".")
            setattr(drafter.get_submodule(module), attr, target.get_buffer(name))
    return drafter.eval()


def _locate(spec: str, role: str, default: bool = False) -> str:
    """A local model folder, or a Hub id to hand to from_pretrained; ModelError for anything else."""
    path = Path(spec).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            hint = ("; train it (benchmarks/train_target.py), pass --target, or set SPECLA_HOME" if default
                    else "; pass the folder written by save_pretrained")
            raise ModelError(f"{role} {spec} has no model in it (no config.json){hint}")
        return str(path)
    if path.exists():
        raise ModelError(f"{role} {spec} is a file; pass the model's folder")
    if default or not _HUB_ID.match(spec):
        raise ModelError(f"{role} not found: {spec} (no such folder)")
    return spec


def _load(location: str, role: str, dtype: torch.dtype, device: torch.device) -> torch.nn.Module:
    try:
        model = AutoModelForCausalLM.from_pretrained(location, dtype=dtype)
    except OSError as e:
        where = "" if Path(location).is_dir() else " (not a local folder, and the Hugging Face Hub lookup failed)"
        raise ModelError(f"cannot load {role} {location}{where}: {_first_line(e)}") from None
    except ValueError as e:               # e.g. an unknown model_type: AutoModel cannot build it
        raise ModelError(f"cannot load {role} {location}: {_first_line(e)}") from None
    return model.to(device).eval()


def _first_line(e: Exception) -> str:
    return str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
