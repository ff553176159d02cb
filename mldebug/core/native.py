"""C kernels of mldebug's own, built with the machine's C compiler on first use.

`library(source, flags)` compiles SOURCE (a .c file shipped in the package) with `$CC`,
else `cc`, `gcc` or `clang`, into a cache folder (`$MLDEBUG_CACHE_DIR`, else
`$XDG_CACHE_HOME/mldebug` or `~/.cache/mldebug`), once per source, flags and machine type
(~0.3 s), and returns the shared library's path; the caller loads it with ctypes and
checks it before use. `disabled()` says whether `MLDEBUG_NATIVE=0` turns them all off.
`readable_address(t)` is the address of a CPU tensor's values when a kernel may read them.

Users: the recorder's statistics (record/native.py, record/fused.c) and the watch's
NaN/Inf check of CPU tensors (watch/native_check.py, watch/finite.c). Each falls back to
torch when its kernel cannot be had.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import operator
import os
import platform
import shlex
import shutil
import subprocess
import sys
import tempfile

import torch

from .user_files import cache_dir, private  # noqa: F401 - the kernels' folder


def disabled() -> bool:
    """MLDEBUG_NATIVE=0 (or off/no/false): no kernel is built or loaded."""
    return os.environ.get("MLDEBUG_NATIVE", "1").strip().lower() in ("0", "off", "no", "false")


# plain tensors: a subclass (DTensor, FakeTensor, a wrapper subclass) may answer data_ptr()
# with an address that is not its values' (FSDP2's DTensor gradients: 0 and 128)
_PLAIN = frozenset(t for t in (torch.Tensor, torch.nn.Parameter,
                               getattr(torch.nn.parameter, "Buffer", None)) if t is not None)


def readable_address(x: torch.Tensor) -> int:
    """The address of X's first value when X (a plain CPU tensor, contiguous) has memory
    of its own that holds all its values; 0 when it must not be read: a tensor subclass,
    a wrapper tensor without storage, autograd's efficient zero tensors and functionalize's
    wrappers (a null pointer), a freed (shrunk) storage."""
    if type(x) not in _PLAIN or not x.is_cpu:
        return 0
    return values_address(x)


def values_address(x: torch.Tensor) -> int:
    """The address of X's first value (on any device) when X has memory of its own that
    holds all its values, else 0 (see readable_address; the device ledger of the watch
    asks it too: FSDP lets gathered parameters go with `resize_(0)`)."""
    try:
        ptr = x.data_ptr()            # a wrapper tensor (no storage) raises
    except RuntimeError:
        return 0
    if not ptr or x._is_zerotensor() or not _in_storage(x):
        return 0
    return ptr


def _in_storage(x: torch.Tensor) -> bool:
    """Whether X's storage still holds every value X addresses: a contiguous (or empty)
    tensor's `storage_offset + numel` values; any other layout (a slice's gaps, an
    expanded tensor's repeats, channels-last) up to the extent of its strides, `_reach`
    (a slice's element count would pass a storage shrunk part of the way: FSDP's
    `resize_`)."""
    if x.is_contiguous() or not x.numel():
        return x.untyped_storage().nbytes() >= (x.storage_offset() + x.numel()) \
            * x.element_size()
    return x.untyped_storage().nbytes() >= _reach(x)


def _reach(x: torch.Tensor) -> int:
    """The bytes of X's storage up to the end of its last element (X not empty), by the
    extent of its strides: any layout, dense, sliced or expanded."""
    last = sum((size - 1) * stride for size, stride in zip(x.shape, x.stride()))
    return (x.storage_offset() + last + 1) * x.element_size()


_first = operator.itemgetter(0)
_T, _S = torch.Tensor, torch._C.StorageBase
# (dense without gaps, as a contiguous tensor: its values end at storage_offset + numel)
_channels_last = functools.partial(_T.is_contiguous, memory_format=torch.channels_last)


def with_values(items: list) -> list:
    """The (tensor, ...) tuples of ITEMS whose tensor has its values (`values_address`
    non-zero), in one call: the watch's device ledger asks it of every tensor it reduces,
    a few hundred a step, where a call each would count on a GPU's launch-bound step.
    First for all at once, in C loops (`map`: no Python frame, ~0.1 us a tensor): when
    every tensor is contiguous (or channels-last: dense too), has elements, an address,
    and memory up to its last element, all are kept. Else `values_address`'s test,
    written out in the loop (~0.5 us a tensor: a sliced, expanded or freed tensor, an
    empty one, a ZeroTensor)."""
    xs = list(map(_first, items))
    try:
        if all(map(_T.numel, xs)) and all(map(operator.or_, map(_T.is_contiguous, xs),
                                              map(_channels_last, xs))) \
                and all(map(_T.data_ptr, xs)) and all(map(
                operator.le,
                map(operator.mul, map(operator.add, map(_T.storage_offset, xs),
                                      map(_T.numel, xs)), map(_T.element_size, xs)),
                map(_S.nbytes, map(_T.untyped_storage, xs)))):
            return items
    except RuntimeError:           # (one without storage: told apart below)
        pass
    kept = []
    for item in items:
        x = item[0]
        try:
            ptr = x.data_ptr()
        except RuntimeError:
            continue
        if ptr and not x._is_zerotensor() and _in_storage(x):
            kept.append(item)
    return kept


def memory_needed(xs: list):
    """(the address of each tensor of XS, the bytes of memory it reaches: its storage
    offset and the extent of its strides), for tensors that will be asked again whether
    they still have their values (an optimizer's parameters and state, every step): while
    the addresses are the same (`p.data = ...` moves them), `storage.nbytes() >= needed`
    says so. None when one of them has no values now (empty, no address, memory let go):
    those are asked in full each time."""
    try:
        addresses = list(map(_T.data_ptr, xs))
        if not all(addresses) or not all(map(_T.numel, xs)):
            return None
        needed = list(map(_reach, xs))
        if all(map(operator.le, needed, map(_S.nbytes, map(_T.untyped_storage, xs)))):
            return addresses, needed
    except RuntimeError:
        pass
    return None


def compiler() -> list:
    cc = os.environ.get("CC")
    if cc:
        return shlex.split(cc)
    for name in ("cc", "gcc", "clang"):
        path = shutil.which(name)
        if path:
            return [path]
    raise OSError("no C compiler (cc, gcc or clang; or set CC)")


def load(source: str, flags: tuple) -> ctypes.CDLL:
    """SOURCE's library, built when missing (`library`) and loaded; a cached library this
    machine cannot load is built again."""
    try:
        return ctypes.CDLL(library(source, flags))
    except OSError:
        return ctypes.CDLL(library(source, flags, rebuild=True))


def library(source: str, flags: tuple, rebuild: bool = False) -> str:
    """The built library's path, built now when missing or REBUILD (written under a
    temporary name and renamed: processes that build at once never see half a file). The
    cache key is the source, the flags and the machine type: a library built once serves
    every later process, with or without a compiler."""
    with open(source, "rb") as f:
        src = f.read()
    key = hashlib.sha256(b"\0".join([src, " ".join(flags).encode(),
                                     platform.machine().encode(), sys.platform.encode()]))
    stem = os.path.splitext(os.path.basename(source))[0]
    path = os.path.join(cache_dir(), f"{stem}-{key.hexdigest()[:16]}.so")
    if os.path.exists(path) and not rebuild:
        return path
    cc = compiler()
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=os.path.dirname(path))
    os.close(fd)
    try:
        error = ""
        # target_clones needs GCC on x86-64 with ifunc support (glibc): else the baseline
        for extra in ([], ["-DMLD_NO_CLONES"]):
            run = subprocess.run(cc + list(flags) + extra + ["-o", tmp, source],
                                 capture_output=True, text=True, timeout=120)
            if run.returncode == 0:
                os.replace(tmp, path)
                return path
            lines = run.stderr.strip().splitlines()
            error = lines[-1] if lines else f"exit status {run.returncode}"
        raise OSError(f"{cc[0]} could not build {os.path.basename(source)}: {error}")
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
