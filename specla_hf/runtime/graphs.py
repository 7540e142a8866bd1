"""CUDA graphs for batch-1 decoding: one mechanism (``StaticCall``) for every captured call.

At batch 1 a decode step is hundreds of small kernels; launched one by one from Python, the GPU waits for the host (an
eager GDN forward is ~15-20x slower than its graph replay on an H200). So each distinct call (a target forward of one
shape, a commit, a draft depth, the device loop's acceptance) is captured once as a CUDA graph and replayed. A
captured function reads and writes static tensors only: no host synchronisation, and the tensors it returns are its
recorded outputs, which every replay rewrites in place.

``GraphSet`` holds one adapter's captured calls by key. ``emulate=True`` swaps CUDA graphs for re-runs of the
function, so that the capture/replay bookkeeping runs, and is tested, on a CPU.
"""
from __future__ import annotations

import warnings
import weakref
from dataclasses import fields, is_dataclass

import torch


def tensors_in(obj) -> list[torch.Tensor]:
    """The tensors in ``obj`` (nested tuples, lists, dicts and dataclasses), in a fixed order."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (tuple, list)):
        return [t for x in obj for t in tensors_in(x)]
    if isinstance(obj, dict):
        return [t for k in sorted(obj, key=str) for t in tensors_in(obj[k])]
    if is_dataclass(obj):
        return [t for f in fields(obj) for t in tensors_in(getattr(obj, f.name))]
    return []


class StaticCall:
    """``fn()`` captured once and replayed: ``outputs`` are what its recorded run returned.

    Capture: one warm-up run on a side stream (Triton compiles and autotunes, cuBLAS makes its handles), then
    ``between()`` outside the graph (to undo the warm-up's effects), then the recorded run, which executes nothing.
    ``python_state = (get, set)`` names Python-side state ``fn`` changes (e.g. which tensors a cache holds as its
    pending nodes): a real replay runs kernels only, so the emulation puts that state back as it was at capture around
    each re-run and copies the new results into ``outputs``; a replay behaves the same either way."""

    def __init__(self, fn, emulate: bool = False, between=None, python_state=None):
        self.fn, self.python_state, self.graph = fn, python_state, None
        if emulate:                      # the recording run executes: the caller undoes its effects as after a capture
            self.captured_state = python_state[0]() if python_state else None
            self.outputs = fn()
            return
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            fn()
        torch.cuda.current_stream().wait_stream(stream)
        if between is not None:
            between()
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.outputs = fn()

    def replay(self):
        if self.graph is not None:
            self.graph.replay()
            return self.outputs
        get, put = self.python_state or (None, None)
        now = get() if get else None
        if put:
            put(self.captured_state)
        for dst, src in zip(tensors_in(self.outputs), tensors_in(self.fn())):
            dst.copy_(src)
        if put:
            put(now)
        return self.outputs


class GraphSet:
    """An adapter's captured calls, by key (each a ``StaticCall``, or ``None`` after a failed capture: that call then
    runs eagerly, which costs speed, never correctness). Calls bound to another object's static tensors too (the
    device loop's acceptance binds the target's and the drafter's) are kept per that ``owner``, weakly, so they go
    with it."""

    def __init__(self, emulate: bool = False):
        self.emulate = emulate
        self.calls: dict = {}
        self.captures = 0                # how many captures ran (a step that captured is no timing of a replay)
        self.statics: dict = {}          # static tensors captured calls read and write (e.g. a drafter's tree)
        self._owned: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def clear(self) -> None:
        """Drop every captured call and static object: the tensors they are bound to are being replaced."""
        self.calls, self.statics = {}, {}
        self._owned = weakref.WeakKeyDictionary()

    def static(self, key, make):
        """The static object under ``key``, made by ``make()`` on first use: kept with the graphs bound to it."""
        if key not in self.statics:
            self.statics[key] = make()
        return self.statics[key]

    def store(self, owner=None) -> dict:
        return self.calls if owner is None else self._owned.setdefault(owner, {})

    def capture(self, key, fn, what: str, between=None, python_state=None, owner=None) -> StaticCall | None:
        """Capture ``fn`` under ``key`` (replacing nothing: callers check ``store``); ``None``, with a warning, if
        capturing fails (``between()`` then runs too, to undo whatever the warm-up did)."""
        store = self.store(owner)
        self.captures += 1
        try:
            store[key] = StaticCall(fn, self.emulate, between, python_state)
        except Exception as e:  # noqa: BLE001 - any capture failure: say so, run eagerly
            warnings.warn(f"SpecLA: capturing {what} in a CUDA graph failed ({type(e).__name__}: {str(e)[:200]}); "
                          "running it eagerly (slower)", RuntimeWarning)
            store[key] = None
            if between is not None:
                between()
        return store[key]

    def call(self, key, fn, what: str, between=None, owner=None):
        """``fn()``'s result: a replay of the call captured under ``key`` (captured on first use), or an eager run
        where its capture failed."""
        store = self.store(owner)
        if key not in store:
            self.capture(key, fn, what, between, owner=owner)
        static = store[key]
        return fn() if static is None else static.replay()
