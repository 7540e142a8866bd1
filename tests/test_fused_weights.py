"""GDNRunner's fused weights (``specla_hf.models.fla_gdn.fuse_mixer_weights``): one GEMM for a mixer's q|k|v|g|a|b projections,
one conv weight for its q|k|v convs, one GEMM for an MLP's gate|up, with the model's parameters as views of them.
The runner must equal the stock forward, follow in-place weight updates, and rebuild after the parameters are
replaced. Run as a script (under TRITON_INTERPRET=1), this file checks fla's kernels on the fused views instead."""
import os
import subprocess
import sys

import pytest
import torch
import torch.nn as nn

from conftest import VARIANTS, tiny_gdn
from specla_hf.models.fla_gdn import GDNRunner, fuse_mixer_weights
from specla_kernels.reference import chain_parents

SHAPES = {**VARIANTS, "conv_bias": {}}


def make_model(name: str, seed: int = 11):
    model = tiny_gdn(seed=seed, **SHAPES[name])
    if name == "conv_bias":        # fla's config cannot ask for conv biases; the stock forward uses them if present
        for block in model.model.layers:
            for conv in (block.attn.q_conv1d, block.attn.k_conv1d, block.attn.v_conv1d):
                conv.bias = nn.Parameter(0.3 * torch.randn(conv.out_channels))
            block.attn.conv_bias = True
    return model


def runner_logits(runner: GDNRunner, ids: torch.Tensor) -> torch.Tensor:
    """Prefill, one autoregressive step, then the rest verified as a chain: the logits of every position."""
    cache = runner.new_cache(ids.shape[0])
    prefill = runner.forward(ids[:, :6], cache, logits_positions=slice(None)).logits
    step = runner.forward(ids[:, 6:7], cache, logits_positions=slice(None)).logits
    tree = runner.forward(ids[:, 7:], cache, parents=chain_parents(ids.shape[1] - 7)).logits
    return torch.cat([prefill, step, tree], 1)


@torch.no_grad()
def check_equals_stock(runner: GDNRunner, ids: torch.Tensor, model=None) -> None:
    """The runner's logits equal ``model``'s (default: the runner's own) stock forward."""
    ref = (model or runner.model)(ids).logits
    torch.testing.assert_close(runner_logits(runner, ids), ref, rtol=1e-5, atol=1e-5)


def fused_params(model) -> list[list[torch.Tensor]]:
    """Per fused tensor, the parameters that must be views of it."""
    groups = []
    for block in model.model.layers:
        m = block.attn
        groups.append([m.q_proj.weight, m.k_proj.weight, m.v_proj.weight, m.a_proj.weight, m.b_proj.weight]
                      + ([m.g_proj.weight] if m.use_gate else []))
        if m.use_short_conv:
            convs = (m.q_conv1d, m.k_conv1d, m.v_conv1d)
            groups.append([c.weight for c in convs])
            if m.q_conv1d.bias is not None:
                groups.append([c.bias for c in convs])
        groups.append([block.mlp.gate_proj.weight, block.mlp.up_proj.weight])
    return groups


def assert_fused(model) -> None:
    for params in fused_params(model):
        assert len({p.untyped_storage().data_ptr() for p in params}) == 1, "parameters are not views of one tensor"


@pytest.mark.parametrize("name", SHAPES)
def test_fused_runner_equals_stock_forward(name):
    model = make_model(name)
    runner = GDNRunner(model)
    ids = torch.randint(0, 97, (1, 13))
    check_equals_stock(runner, ids)
    assert_fused(model)                       # and the stock forward above ran on the views
    m = model.model.layers[0].attn
    proj, conv_weight, conv_bias = fuse_mixer_weights(m)
    ptrs = [None if t is None else t.data_ptr() for t in (proj, conv_weight, conv_bias)]
    assert [None if t is None else t.data_ptr() for t in fuse_mixer_weights(m)] == ptrs   # idempotent: no rebuild
    rows = 2 * m.key_dim + m.value_dim + (m.value_dim if m.use_gate else 0) + 2 * m.num_v_heads
    assert proj.shape == (rows + -rows % 64, m.hidden_size)          # zero rows pad it to a multiple of 64
    assert torch.equal(proj[:m.key_dim], m.q_proj.weight) and torch.equal(proj[rows - m.num_v_heads:rows],
                                                                          m.b_proj.weight)
    assert not proj[rows:].any()
    if m.use_short_conv:
        assert conv_weight.shape == (2 * m.key_dim + m.value_dim, m.conv_size)
        assert (conv_bias is not None) == (name == "conv_bias")
    else:
        assert conv_weight is None and conv_bias is None


def test_in_place_updates_reach_the_runner():
    model = make_model("conv_bias")
    runner = GDNRunner(model)
    ids = torch.randint(0, 97, (1, 12))
    before = runner_logits(runner, ids)
    fused = [fuse_mixer_weights(block.attn)[0] for block in model.model.layers]
    with torch.no_grad():
        model.model.layers[0].attn.k_proj.weight.mul_(2)
        model.model.layers[1].attn.v_conv1d.bias.add_(0.5)
        model.model.layers[1].mlp.up_proj.weight.mul_(-1)
    after = runner_logits(runner, ids)
    assert not torch.allclose(after, before, atol=1e-3)
    check_equals_stock(runner, ids)

    # an optimizer step (in place on every parameter, so on the views) and load_state_dict's copy_
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    opt.step()
    check_equals_stock(runner, ids)
    other = make_model("conv_bias", seed=12)
    model.load_state_dict(other.state_dict())
    check_equals_stock(runner, ids, other)
    assert all(fuse_mixer_weights(block.attn)[0] is f for block, f in zip(model.model.layers, fused))  # no rebuild
    assert_fused(model)


def test_replaced_parameters_are_fused_again():
    model = make_model("gva")
    runner = GDNRunner(model)
    ids = torch.randint(0, 97, (1, 12))
    check_equals_stock(runner, ids)
    old = fuse_mixer_weights(model.model.layers[0].attn)[0]

    model.to(torch.float64)                   # new storage for every parameter: the runner re-fuses, in float64
    check_equals_stock(runner, ids)
    assert runner_logits(runner, ids).dtype == torch.float64
    assert_fused(model)
    model.to(torch.float32)
    check_equals_stock(runner, ids)
    assert_fused(model)
    assert fuse_mixer_weights(model.model.layers[0].attn)[0] is not old

    other = make_model("gva", seed=13)        # new Parameter objects sharing the other model's storage
    model.load_state_dict(other.state_dict(), assign=True)
    check_equals_stock(runner, ids, other)
    assert_fused(model)
    check_equals_stock(GDNRunner(other), ids)  # re-pointing model's parameters left the other model alone


def test_fusing_in_inference_mode_leaves_the_model_trainable():
    model = make_model("base")
    ids = torch.randint(0, 97, (1, 10))
    with torch.inference_mode():
        runner_logits(GDNRunner(model), ids)
    model(ids, labels=ids).loss.backward()         # inference tensors would refuse to be saved for backward
    torch.optim.AdamW(model.parameters(), lr=1e-2).step()
    check_equals_stock(GDNRunner(model), ids)
    assert_fused(model)


def test_fused_model_saves_and_reloads(tmp_path):
    """save_pretrained sees parameters sharing one storage; transformers must write each of them whole."""
    model = make_model("base")
    runner = GDNRunner(model)
    ids = torch.randint(0, 97, (1, 10))
    logits = runner_logits(runner, ids)
    model.save_pretrained(tmp_path)
    loaded = type(model).from_pretrained(tmp_path).eval()
    for key, value in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[key], value), key
    torch.testing.assert_close(runner_logits(GDNRunner(loaded), ids), logits, rtol=1e-5, atol=1e-5)


@pytest.mark.interpret
def test_fla_kernels_read_the_fused_views():
    """The CUDA path (fla's conv, recurrent, gated-norm and SwiGLU kernels; our tree kernels) on strided column
    views of the fused GEMMs' outputs, run in Triton's interpreter by this file as a script."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True, timeout=900,
                          cwd=os.path.dirname(__file__))
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert proc.stdout.strip().splitlines()[-1] == "ok", proc.stdout[-2000:]


if __name__ == "__main__":
    assert os.environ.get("TRITON_INTERPRET") == "1"
    import triton.runtime.autotuner

    # the autotuner times configs on a GPU driver; under the interpreter there is none
    triton.runtime.autotuner.Autotuner._bench = lambda self, *a, config=None, **k: [0.0, 0.0, 0.0]
    from specla_hf.models.fla_backend import use_backend

    for name in ("base", "gva", "no_gate", "conv_bias"):
        model = make_model(name)
        if name == "gva":              # fla's plain swiglu + down_proj instead of swiglu_linear
            for block in model.model.layers:
                block.mlp.fuse_swiglu = False
        ids = torch.randint(0, 97, (1, 11))
        with torch.no_grad():
            ref = model(ids).logits        # the torch path, unfused modules
        with use_backend(modules="fla", delta_rule="fla"):
            got = runner_logits(GDNRunner(model), ids)
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5, msg=name)
    print("ok")
