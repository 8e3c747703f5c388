"""The host's reads of tensor values, counted where they happen on the CPU: on a GPU each one waits for the device
to finish everything queued before it (a sync), which is what async scheduling must not do while it stages a step.

    with HostReads() as reads:
        ...
    assert not reads.counts, reads.counts

Counted: the ops whose result size or value the host needs (a scalar read, nonzero, a boolean mask's indexing,
masked_select, equal, unique) and Tensor.tolist / numpy / __array__ (which on the CPU go through no op)."""

from __future__ import annotations

from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten
READS = {
    aten._local_scalar_dense,
    aten.nonzero,
    aten.masked_select,
    aten.equal,
    aten._unique2,
    aten.unique_consecutive,
    aten.unique_dim,
}
MASKED = {aten.index, aten.index_put, aten.index_put_, aten._index_put_impl_}  # reads when an index is a bool mask
METHODS = ("tolist", "numpy", "__array__")


class HostReads(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.counts: Counter[str] = Counter()
        self._saved: dict[str, object] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        packet = func.overloadpacket
        if packet in READS:
            self.counts[packet.__name__] += 1
        elif packet in MASKED:
            indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
            if any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in indices or ()):
                self.counts[f"{packet.__name__} (bool mask)"] += 1
        return func(*args, **kwargs)

    def __enter__(self):
        for name in METHODS:
            self._saved[name] = original = getattr(torch.Tensor, name)
            setattr(torch.Tensor, name, self._counted(name, original))
        return super().__enter__()

    def __exit__(self, *exc):
        for name, original in self._saved.items():
            setattr(torch.Tensor, name, original)
        return super().__exit__(*exc)

    def _counted(self, name, original):
        def read(tensor, *args, **kwargs):
            self.counts[name] += 1
            return original(tensor, *args, **kwargs)

        return read
