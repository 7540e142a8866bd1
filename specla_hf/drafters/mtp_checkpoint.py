"""The ``mtp.*`` tensors of a Qwen3.5 / Qwen3.5-MoE / Qwen3-Next checkpoint: found, read and written without the
rest of the model.

Released checkpoints keep the multi-token-prediction (MTP) head beside the model's weights, under ``mtp.``:

    mtp.fc.weight                        [H, 2H]  over concat(embedding side, hidden side)
    mtp.pre_fc_norm_embedding.weight     [H]
    mtp.pre_fc_norm_hidden.weight        [H]
    mtp.layers.0.*                       one decoder layer named as the model's own (input_layernorm, self_attn.*,
                                         post_attention_layernorm, mlp.*); MoE experts either one tensor per expert
                                         (mlp.experts.{e}.{gate,up,down}_proj.weight) or fused as transformers keeps
                                         them (mlp.experts.gate_up_proj [E, 2I, H], mlp.experts.down_proj [E, H, I])
    mtp.norm.weight                      [H]

and the text config says ``mtp_num_hidden_layers`` (1 in every released checkpoint). That is transformers'
``MtpLayer`` (``transformers.modeling_layers``) with ``MODULE_NAMES`` as its parameter names. A sharded checkpoint's
``model.safetensors.index.json`` names the shards holding ``mtp.*``: only those are opened, and for a Hub repository
only those are fetched (or read from the Hub cache, offline).
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from huggingface_hub import hf_hub_download
from huggingface_hub.errors import EntryNotFoundError
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import AutoConfig, PretrainedConfig

PREFIX = "mtp."
INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
DRAFT_VOCAB = "draft_vocab.safetensors"      # a head's draft vocabulary (``MTPDrafter.restrict_vocabulary``), if any
# checkpoint name (after ``mtp.``) -> ``MtpLayer`` name, by prefix
MODULE_NAMES = (("fc.", "eh_proj."), ("pre_fc_norm_embedding.", "enorm."), ("pre_fc_norm_hidden.", "hnorm."),
                ("layers.0.", "mtp_block."), ("norm.", "post_norm."))
PER_EXPERT = re.compile(r"^(.*\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


def _file(source: str | Path, filename: str, revision: str | None, local_files_only: bool) -> Path | None:
    """``filename`` of a local folder, or of a Hub repository (fetched, or from the Hub cache when offline:
    ``local_files_only`` or ``HF_HUB_OFFLINE=1``); ``None`` where it has no such file."""
    folder = Path(source)
    if folder.is_dir():
        path = folder / filename
        return path if path.is_file() else None
    try:
        return Path(hf_hub_download(str(source), filename, revision=revision, local_files_only=local_files_only))
    except EntryNotFoundError:        # not in the repository, or (offline) not in the Hub cache
        return None


def read_config(source: str | Path, revision: str | None = None, local_files_only: bool = False) -> PretrainedConfig:
    """The text config of the checkpoint at ``source`` (a vision-language model's text part)."""
    config = AutoConfig.from_pretrained(source, revision=revision, local_files_only=local_files_only)
    return config.get_text_config()


def read_tensors(source: str | Path, revision: str | None = None, local_files_only: bool = False
                 ) -> dict[str, torch.Tensor]:
    """Every ``mtp.*`` tensor at ``source``, named without the prefix, on the CPU in the stored dtype: through the
    shard index when there is one (only the shards holding them are opened), else from ``model.safetensors``."""
    index = _file(source, INDEX, revision, local_files_only)
    if index is not None:
        weight_map = json.loads(index.read_text())["weight_map"]
        shards = sorted({shard for name, shard in weight_map.items() if name.startswith(PREFIX)})
    else:
        shards = [SINGLE]
    tensors = {}
    for shard in shards:
        path = _file(source, shard, revision, local_files_only)
        if path is None:
            raise FileNotFoundError(f"{source} has no {shard}" + (f", which {INDEX} names" if index else "")
                                    + " (offline, a Hub repository must be in the Hub cache)")
        with safe_open(str(path), framework="pt", device="cpu") as f:
            tensors.update({name[len(PREFIX):]: f.get_tensor(name) for name in f.keys() if name.startswith(PREFIX)})
    if not tensors:
        raise ValueError(f"{source} holds no mtp.* tensors: the checkpoint ships no multi-token-prediction head "
                         f"(train one with `specla-train-drafter --mtp --target {source} ...`)")
    return tensors


def module_state(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Checkpoint tensors (``read_tensors``) under ``MtpLayer``'s names, per-expert MoE tensors fused as transformers
    keeps them. A name outside the supported structure is a one-line ``ValueError``."""
    state, unknown = {}, []
    for name, tensor in _fuse_experts(tensors).items():
        renamed = next((module + name[len(saved):] for saved, module in MODULE_NAMES if name.startswith(saved)), None)
        if renamed is None:
            unknown.append(PREFIX + name)
        else:
            state[renamed] = tensor
    if unknown:
        raise ValueError(f"unsupported MTP structure: the checkpoint holds {sorted(unknown)[:6]}; MTPDrafter reads "
                         "one MTP layer (mtp.fc, mtp.pre_fc_norm_*, mtp.layers.0, mtp.norm) on the target's "
                         "embeddings")
    return state


def _fuse_experts(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Per-expert MoE tensors merged into transformers' fused ones: ``gate_up_proj [E, 2I, H]`` (each expert's gate
    rows, then its up rows) and ``down_proj [E, H, I]``, as transformers' checkpoint conversion for these families
    merges them; other tensors as they are."""
    out, experts = {}, {}
    for name, tensor in tensors.items():
        match = PER_EXPERT.match(name)
        if match is None:
            out[name] = tensor
        else:
            experts.setdefault(match[1], {}).setdefault(match[3], {})[int(match[2])] = tensor
    for prefix, projections in experts.items():
        count = len(projections.get("down_proj", ()))
        if set(projections) != {"gate_proj", "up_proj", "down_proj"} or any(
                sorted(p) != list(range(count)) for p in projections.values()):
            raise ValueError(f"unsupported MTP structure: {PREFIX}{prefix} does not hold gate, up and down "
                             "projections for the same experts 0..E-1")
        stacked = {kind: torch.stack([p[e] for e in range(count)]) for kind, p in projections.items()}
        out[f"{prefix}.gate_up_proj"] = torch.cat([stacked["gate_proj"], stacked["up_proj"]], 1)
        out[f"{prefix}.down_proj"] = stacked["down_proj"]
    return out


def write(folder: str | Path, config: PretrainedConfig, state: dict[str, torch.Tensor]) -> None:
    """``config`` (the target's text config) and an ``MtpLayer`` state dict in the checkpoint layout: ``config.json``
    and ``model.safetensors`` of ``mtp.*`` tensors only, which ``read_config`` / ``read_tensors`` read back."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(folder)
    saved = {}
    for name, tensor in state.items():
        stored = next(saved_name + name[len(module):] for saved_name, module in MODULE_NAMES
                      if name.startswith(module))
        saved[PREFIX + stored] = tensor.detach().contiguous().cpu()
    save_file(saved, str(folder / SINGLE), metadata={"format": "pt"})


def write_draft_vocab(folder: str | Path, token_ids: torch.Tensor | None) -> None:
    """``token_ids`` as the folder's draft vocabulary (``None``: none, an earlier one removed)."""
    path = Path(folder) / DRAFT_VOCAB
    if token_ids is None:
        path.unlink(missing_ok=True)
    else:
        save_file({"token_ids": token_ids.detach().cpu().contiguous()}, str(path), metadata={"format": "pt"})


def read_draft_vocab(source: str | Path, revision: str | None = None,
                     local_files_only: bool = False) -> torch.Tensor | None:
    """The draft vocabulary saved with a head at ``source``, or ``None``."""
    path = _file(source, DRAFT_VOCAB, revision, local_files_only)
    if path is None:
        return None
    with safe_open(str(path), framework="pt") as f:
        return f.get_tensor("token_ids")
