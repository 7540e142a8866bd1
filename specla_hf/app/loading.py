"""Which target and drafter the CLI and the demo run, and loading them with one-line errors.

The embedded models live under ``$SPECLA_HOME`` (default: the ``checkpoints/`` folder of this repository, which an
editable install points into) and are named by their folder: the default target ``specla-gdn-tiny`` (fla GDN) and
``specla-qwen35-tiny`` (a Qwen3.5 hybrid), each with its aligned drafter ``<name>-drafter`` beside it, which is the
default drafter for it. For a target of the user's choosing without ``--drafter``, or without the aligned drafter,
the drafter is the target's own first block ("layer-skip"): embeddings, block 1, final norm and LM head as a
one-block model, which needs no training and always fits the target.

A Hugging Face Hub id is looked up in the local Hub cache first, and only then on the Hub, after a quick check that
the Hub answers: transformers retries an unreachable Hub for about half a minute before it gives up.
"""
from __future__ import annotations

import copy
import os
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from specla_hf.app.choices import DTYPE_NAMES, LAYER_SKIP, MTP, ModelError
from specla_hf.generation import draft_options, make_drafter

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_TARGET = "specla-gdn-tiny"
DEFAULT_DRAFTER = f"{DEFAULT_TARGET}-drafter"
DTYPES = {name: getattr(torch, name) for name in DTYPE_NAMES}
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")
HUB_TIMEOUT_S = 5.0                # how long the Hub may take to say whether it has a model


@dataclass
class Models:
    target: torch.nn.Module            # fla GatedDeltaNetForCausalLM
    drafter: torch.nn.Module           # a draft model, a SpecLADrafter or an MTPDrafter
    tokenizer: object                  # the target's tokenizer
    target_name: str
    drafter_name: str                  # where the drafter came from and what kind it is, for stats lines and the demo


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
    layer-skip drafter from the target, ``drafter="mtp"`` reads the target checkpoint's MTP head. ``dtype="auto"``
    is float32 on the CPU and bfloat16 on CUDA.
    """
    dev = resolve_device(device)
    torch_dtype = DTYPES[dtype] if dtype != "auto" else (torch.bfloat16 if dev.type == "cuda" else torch.float32)
    home = checkpoint_home()
    embedded = target is None or (home / target / "config.json").is_file()    # a name of a model under ``home``
    target_name = DEFAULT_TARGET if target is None else target
    if embedded:
        target_loc = _locate(str(home / target_name), "default target" if target is None else "target",
                             default=target is None)
    else:
        target_loc = _locate(target, "target")

    # imported once the arguments are checked, not at the top: they take seconds. fla registers its model types
    # with the Auto classes (and specla_hf gives them SpecLA's generate)
    import fla.models  # noqa: F401  (imported for what it registers)
    from transformers import AutoTokenizer

    from specla_hf.models import adapter_for

    target_model = _load(target_loc, "target", torch_dtype, dev)
    try:
        adapter_for(target_model)              # a model family SpecLA drives, in a configuration it supports
    except (TypeError, NotImplementedError) as e:
        raise ModelError(f"target {target_name}: {e}") from None
    try:
        tokenizer = AutoTokenizer.from_pretrained(target_loc.path, local_files_only=target_loc.local)
    except (OSError, ValueError) as e:
        raise ModelError(f"target {target_name} has no usable tokenizer: {_first_line(e)}") from None

    # an embedded target's aligned drafter, when it is there, is ``<target>-drafter`` beside it
    aligned_name = f"{target_name}-drafter"
    drafter_source = drafter
    if drafter is None and embedded and (home / aligned_name / "config.json").is_file():
        drafter, drafter_source = str(home / aligned_name), aligned_name
    if drafter is None or drafter == LAYER_SKIP:
        drafter_model = layer_skip_drafter(target_model)
        drafter_name = f"layer-skip (the target's block 1 of {target_model.config.num_hidden_layers})"
    elif drafter == MTP:
        from specla_hf import MTPDrafter

        try:
            drafter_model = MTPDrafter.from_pretrained(target_loc.path, dtype=torch_dtype, device=dev,
                                                       local_files_only=target_loc.local)
        except (OSError, ValueError) as e:
            raise ModelError(f"--drafter {MTP}: target {target_name}: {_first_line(e)}") from None
        drafter_name = f"{MTP} (the MTP head of {target_name})"
    else:
        drafter_model = _load(_locate(drafter, "drafter"), "drafter", torch_dtype, dev)
        drafter_name = f"{drafter_source} ({drafter_kind(drafter_model)})"
    try:
        make_drafter(target_model, drafter_model, draft_options(tree=True))
    except (TypeError, ValueError, NotImplementedError) as e:
        raise ModelError(f"drafter {drafter or LAYER_SKIP}: {e}") from None
    return Models(target_model, drafter_model, tokenizer, target_name, drafter_name)


def drafter_kind(drafter: torch.nn.Module) -> str:
    from specla_hf import SpecLADartDrafter, SpecLADrafter

    if isinstance(drafter, SpecLADartDrafter):       # a subclass of SpecLADrafter: test it first
        return "DART-style parallel drafter"
    if isinstance(drafter, SpecLADrafter):
        return "EAGLE-style aligned drafter"
    return "draft model"


def layer_skip_drafter(target: torch.nn.Module) -> torch.nn.Module:
    """The target's embeddings, first block, final norm and LM head as a one-block model of the target's class (an
    fla GDN, or a hybrid whose first block is a GDN layer), weights and buffers shared, not copied."""
    from specla_hf.models.qwen3_5 import text_decoder

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


@dataclass
class _Location:
    path: str                  # a local folder or a Hub id, for from_pretrained
    local: bool                # load without the network: a folder, or a Hub id the local Hub cache holds


def _locate(spec: str, role: str, default: bool = False) -> _Location:
    """A local model folder, or a Hub id that the local Hub cache or the Hub itself can serve; ModelError for
    anything else."""
    path = Path(spec).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            hint = ("; train it (benchmarks/train_target.py), pass --target, or set SPECLA_HOME" if default
                    else "; pass the folder written by save_pretrained")
            raise ModelError(f"{role} {spec} has no model in it (no config.json){hint}")
        return _Location(str(path), local=True)
    if path.exists():
        raise ModelError(f"{role} {spec} is a file; pass the model's folder")
    # a name under an existing local folder ("checkpoints/typo") is a mistyped path, not a Hub id
    if default or not _HUB_ID.match(spec) or (path.parent != Path(".") and path.parent.is_dir()):
        raise ModelError(f"{role} not found: {spec} (no such folder)")
    return _Location(spec, local=_in_hub_cache(spec, role))


def _in_hub_cache(repo_id: str, role: str) -> bool:
    """True when the local Hub cache holds ``repo_id``, False when the Hub has it to download; ModelError within
    seconds when neither does (from_pretrained would retry an unreachable Hub for about half a minute)."""
    from huggingface_hub import constants, model_info, try_to_load_from_cache
    from huggingface_hub.errors import GatedRepoError, HfHubHTTPError, RepositoryNotFoundError

    if isinstance(try_to_load_from_cache(repo_id, "config.json"), str):
        return True
    if constants.is_offline_mode():
        raise ModelError(f"{role} {repo_id} is not in the local Hugging Face cache and HF_HUB_OFFLINE is set: "
                         f"download it first (hf download {repo_id}) or pass a local folder")
    try:
        model_info(repo_id, timeout=HUB_TIMEOUT_S)
    except GatedRepoError:
        raise ModelError(f"{role} {repo_id} is gated on the Hugging Face Hub: accept its terms on its Hub page, "
                         "then log in (hf auth login)") from None
    except RepositoryNotFoundError:
        raise ModelError(f"{role} {repo_id}: no such model on the Hugging Face Hub (a private one needs "
                         "hf auth login)") from None
    except HfHubHTTPError as e:
        raise ModelError(f"{role} {repo_id}: the Hugging Face Hub answered {_first_line(e)}") from None
    except Exception as e:      # refused, unresolved or timed out: the error type depends on the HTTP library
        raise ModelError(f"cannot reach the Hugging Face Hub ({constants.ENDPOINT}) for {role} {repo_id} "
                         f"({_first_line(e)}): pass a local folder, or download it where the Hub is reachable "
                         f"(hf download {repo_id})") from None
    return False


def _load(location: _Location, role: str, dtype: torch.dtype, device: torch.device) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    try:
        model = AutoModelForCausalLM.from_pretrained(location.path, dtype=dtype, local_files_only=location.local)
    except (OSError, ValueError) as e:       # ValueError: e.g. a model_type no installed library defines
        raise ModelError(f"cannot load {role} {location.path}: {_first_line(e)}") from None
    return model.to(device).eval()


def _first_line(e: Exception) -> str:
    return str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
