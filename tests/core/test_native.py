"""mldebug's C kernels: where they are built and cached, and which tensors they may read
(mldebug/core/native.py)."""
from __future__ import annotations

import torch

from mldebug.core import native


def test_the_kernels_are_only_loaded_from_a_private_folder(tmp_path, monkeypatch):
    """A library found in the cache is loaded into the process: a cache folder that
    other users may write to (a shared /tmp) is not used."""
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    monkeypatch.setenv("MLDEBUG_CACHE_DIR", str(shared))
    assert not native.private(str(shared))
    assert native.cache_dir() != str(shared)
    mine = tmp_path / "mine"
    monkeypatch.setenv("MLDEBUG_CACHE_DIR", str(mine))
    assert native.cache_dir() == str(mine) and (mine.stat().st_mode & 0o777) == 0o700


def test_a_kernel_reads_only_tensors_with_memory_of_their_own():
    t = torch.arange(6.0)
    assert native.readable_address(t) == t.data_ptr() != 0
    assert native.readable_address(t[2:]) == t.data_ptr() + 8     # a view: its first value
    freed = torch.ones(4)
    freed.untyped_storage().resize_(0)                             # a freed storage
    assert native.readable_address(freed) == 0
    zero = torch._efficientzerotensor(3)                           # autograd's zeros
    assert native.readable_address(zero) == 0
    assert native.readable_address(torch.empty(0)) in (0, torch.empty(0).data_ptr())


def test_mldebug_native_0_turns_every_kernel_off(monkeypatch):
    monkeypatch.setenv("MLDEBUG_NATIVE", "0")
    assert native.disabled()
    monkeypatch.setenv("MLDEBUG_NATIVE", "1")
    assert not native.disabled()


def test_a_tensor_subclass_is_never_read_by_address():
    """A subclass may answer data_ptr() with an address that is not its values' (FSDP2's
    DTensor gradients answered 0 and 128, and reading 128 crashed the process)."""
    class Wrapped(torch.Tensor):
        pass

    plain = torch.ones(3)
    assert native.readable_address(plain) != 0
    assert native.readable_address(plain.as_subclass(Wrapped)) == 0
    assert native.readable_address(torch.nn.Parameter(torch.ones(3))) != 0
