"""The one capture mechanism (``StaticCall``, ``GraphSet``) on a CPU, through its emulation: captured once, replayed
with the recorded outputs rewritten in place, Python-side state restored around a replay, a failed capture run
eagerly with a warning, calls bound to another object kept only as long as it lives."""
from __future__ import annotations

import gc

import pytest
import torch

from specla_hf.runtime.graphs import GraphSet, StaticCall, tensors_in


def test_a_replay_rewrites_the_recorded_outputs_in_place():
    x = torch.tensor([1.0, 2.0])
    runs = []

    def fn():
        runs.append(1)
        return {"y": x * 2, "pair": (x + 1, None)}
    call = StaticCall(fn, emulate=True)
    recorded = call.outputs
    y, first = recorded["y"], recorded["pair"][0]
    x.copy_(torch.tensor([5.0, 7.0]))
    out = call.replay()
    assert out is recorded and out["y"] is y and torch.equal(y, torch.tensor([10.0, 14.0]))
    assert torch.equal(first, torch.tensor([6.0, 8.0])) and len(runs) == 2
    assert [t.data_ptr() for t in tensors_in(out)] == [first.data_ptr(), y.data_ptr()]


def test_python_side_state_is_as_at_capture_during_a_replay_and_restored_after():
    """A real replay runs kernels only: the emulation runs ``fn`` with the Python-side state it was captured with
    and leaves the state as the caller had it."""
    state = {"pending": "captured"}
    seen = []

    def fn():
        seen.append(state["pending"])
        state["pending"] = "changed by fn"
        return torch.zeros(1)
    call = StaticCall(fn, emulate=True, python_state=(lambda: state["pending"],
                                                      lambda v: state.__setitem__("pending", v)))
    state["pending"] = "the caller's"
    call.replay()
    assert seen == ["captured", "captured"] and state["pending"] == "the caller's"


def test_a_graph_set_captures_once_per_key_and_counts_captures():
    graphs = GraphSet(emulate=True)
    counter = torch.zeros(1)

    def step():
        counter.add_(1)
        return counter.clone()
    for _ in range(3):
        graphs.call(("step",), step, "a step")
    assert list(graphs.calls) == [("step",)] and graphs.captures == 1
    # the first call runs ``step`` twice, as on a GPU (a real capture's warm-up, then the replay): what is captured
    # this way must be idempotent, or undo the warm-up through ``between``
    assert counter.item() == 4
    made = []
    buffers = graphs.static("buffers", lambda: made.append(1) or torch.zeros(2))
    assert graphs.static("buffers", lambda: made.append(1) or torch.zeros(2)) is buffers and made == [1]


def test_a_failed_capture_warns_undoes_and_runs_eagerly(monkeypatch):
    import specla_hf.runtime.graphs as module

    class Broken(StaticCall):
        def __init__(self, *args, **kwargs):
            raise RuntimeError("operation not permitted when stream is capturing")
    monkeypatch.setattr(module, "StaticCall", Broken)
    graphs, undone, ran = GraphSet(emulate=True), [], []
    with pytest.warns(RuntimeWarning, match="capturing the thing in a CUDA graph failed .* running it eagerly"):
        assert graphs.call("k", lambda: ran.append(1) or 41, "the thing", between=lambda: undone.append(1)) == 41
    assert graphs.calls["k"] is None and undone == [1]
    assert graphs.call("k", lambda: ran.append(1) or 42, "the thing") == 42 and len(ran) == 2   # eager from now on


def test_calls_bound_to_an_owner_go_with_it():
    class Owner:
        pass
    graphs, owner = GraphSet(emulate=True), Owner()
    graphs.call("tail", lambda: torch.ones(1), "a tail", owner=owner)
    assert "tail" in graphs.store(owner) and "tail" not in graphs.calls
    del owner
    gc.collect()
    assert len(graphs._owned) == 0
