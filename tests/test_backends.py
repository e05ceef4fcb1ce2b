"""Which kernels run: "auto" is Triton on CUDA and the PyTorch path (with the C++ kernels) on CPU; an explicit
"triton" needs the package."""
from types import SimpleNamespace

import pytest

from pagedmoe.worker import backends
from pagedmoe.worker.backends import select_attention_backend, select_moe_backend


@pytest.mark.parametrize("device, choice, expected", [
    ("cpu", "auto", "torch"), ("cuda", "auto", "triton"), ("cuda:1", "auto", "triton"),
    ("cpu", "triton", "triton"), ("cuda", "torch", "torch"),
])
def test_choice_by_device(device, choice, expected, monkeypatch):
    monkeypatch.setattr(backends.importlib.util, "find_spec", lambda name: object())
    config = SimpleNamespace(device=device, attention_backend=choice, moe_backend=choice)
    assert select_attention_backend(config) == select_moe_backend(config) == expected


def test_without_triton_auto_falls_back_and_triton_is_refused(monkeypatch):
    monkeypatch.setattr(backends.importlib.util, "find_spec", lambda name: None)
    assert select_attention_backend(SimpleNamespace(device="cuda", attention_backend="auto")) == "torch"
    with pytest.raises(ValueError, match="moe_backend: 'triton' needs the triton package"):
        select_moe_backend(SimpleNamespace(device="cpu", moe_backend="triton"))
