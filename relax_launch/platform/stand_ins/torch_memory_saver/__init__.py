"""CPU stand-in for ``torch_memory_saver``, used only with device cpu.

SGLang's ``--enable-memory-saver`` path allocates weights and KV pools inside ``region(tag)`` and
calls ``pause(tag)``/``resume(tag)`` on ``release_memory_occupation``/``resume_memory_occupation``.
On CUDA the real package unmaps physical memory and keeps virtual addresses. Here a
``TorchFunctionMode`` records the storages that a region allocates; ``pause`` returns their pages
to the kernel with ``madvise(MADV_DONTNEED)`` (the addresses stay valid and read as zeros), after
writing them to a file when the region asked for a CPU backup (a host copy would not lower
resident memory on a CPU). ``resume`` reads the file back, or re-reserves zeroed pages.
"""

from __future__ import annotations

import ctypes
import logging
import os
import tempfile
import weakref
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves

_MADV_DONTNEED = 4
_PAGE = os.sysconf("SC_PAGESIZE")
_TAG_DEFAULT = "default"
# Where CPU backups go (relax_launch.platform.MEMORY_SAVER_DIR_ENV); tempfile's default otherwise.
BACKUP_DIR_ENV = "RELAX_MEMORY_SAVER_DIR"
logger = logging.getLogger(__name__)
_libc = ctypes.CDLL(None, use_errno=True)
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]


def _storages(value: Any) -> list[torch.UntypedStorage]:
    return [
        t.untyped_storage()
        for t in tree_leaves(value)
        if isinstance(t, torch.Tensor) and t.layout is torch.strided and t.device.type == "cpu"
    ]


class _Recorder(TorchFunctionMode):
    """Claims for ``tag`` every new storage a torch call returns while the region is active."""

    def __init__(self, saver: TorchMemorySaver, tag: str, backup: bool) -> None:
        super().__init__()
        self.saver, self.tag, self.backup = saver, tag, backup

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if self.saver._disabled or self.saver._active[-1] is not self:  # the innermost claims
            return out
        inputs = {id(s) for s in _storages((args, kwargs))}
        for storage in _storages(out):
            # In-place ops and views return storages they did not allocate; storages that torch's
            # allocator does not own (mmapped files, numpy buffers) are not ours to release.
            if id(storage) in inputs or not storage.resizable() or storage.nbytes() == 0:
                continue
            self.saver._owners.setdefault(storage, (self.tag, self.backup))
        return out


class TorchMemorySaver:
    """The module singleton's type: regions, and pause/resume by tag."""

    def __init__(self) -> None:
        self.hook_mode = "cpu"  # SGLang sets "torch" on XPU; nothing reads it here
        # Weak keys: a storage freed by its owners is forgotten, never released or restored.
        self._owners: weakref.WeakKeyDictionary[torch.UntypedStorage, tuple[str, bool]] = (
            weakref.WeakKeyDictionary()
        )
        self._paused: dict[str, list[tuple[weakref.ref, int, int, bool]]] = {}
        self._files: dict[str, str] = {}
        self._disabled = 0
        self._active: list[_Recorder] = []

    @property
    def enabled(self) -> bool:
        return True

    @contextmanager
    def region(self, tag: str = _TAG_DEFAULT, enable_cpu_backup: bool = False) -> Iterator[None]:
        """Tensors allocated inside belong to ``tag``."""
        recorder = _Recorder(self, tag, enable_cpu_backup)
        self._active.append(recorder)
        try:
            with recorder:
                yield
        finally:
            self._active.pop()

    def cuda_graph(self, **kwargs: Any):
        """No graphs on a CPU: a plain context."""
        return nullcontext()

    @contextmanager
    def disable(self) -> Iterator[None]:
        """Allocations inside are not claimed by the enclosing region."""
        self._disabled += 1
        try:
            yield
        finally:
            self._disabled -= 1

    def pause(self, tag: str | None = None) -> None:
        """Release the pages of ``tag``'s live storages (every tag when None); idempotent."""
        for name in self._tags(tag):
            if name in self._paused:
                continue
            owned = [(s, b) for s, (t, b) in list(self._owners.items()) if t == name]
            entries = [(weakref.ref(s), s.data_ptr(), s.nbytes(), b) for s, b in owned]
            path = self._back_up(name, entries) if any(b for _, b in owned) else None
            # Released only once every backup is written: a failed write loses nothing.
            for _, ptr, size, _ in entries:
                _release(ptr, size)
            self._paused[name] = entries
            if path is not None:
                self._files[name] = path
            logger.info(
                "memory saver paused %r: %d storages, %d bytes%s",
                name,
                len(entries),
                sum(e[2] for e in entries),
                f" (backed up to {path})" if path else "",
            )

    def _back_up(self, tag: str, entries: list[tuple[weakref.ref, int, int, bool]]) -> str:
        """Write the storages that asked for a backup, in order, to a new file; returns its path."""
        folder = os.environ.get(BACKUP_DIR_ENV)
        with tempfile.NamedTemporaryFile(
            prefix=f"memory-saver-{tag}-", dir=folder, delete=False
        ) as backup:
            try:
                for _, ptr, size, wanted in entries:
                    if wanted:
                        backup.write(_view(ptr, size))
            except BaseException:
                os.unlink(backup.name)
                raise
        return backup.name

    def resume(self, tag: str | None = None) -> None:
        """Bring ``tag``'s pages back: restored from the backup, else zeroed; idempotent."""
        for name in self._tags(tag):
            entries = self._paused.pop(name, None)
            if entries is None:
                continue
            path = self._files.pop(name, None)
            with open(path, "rb") if path else nullcontext() as backup:
                offset = 0  # the file holds the backed-up storages back to back, in order
                for ref, ptr, size, backed_up in entries:
                    alive = ref() is not None  # one freed while paused may have a new owner
                    if alive and backed_up:
                        backup.seek(offset)
                        backup.readinto(_view(ptr, size))
                    elif alive:
                        ctypes.memset(ptr, 0, size)  # re-reserve the pages, as CUDA resume does
                    offset += size if backed_up else 0
            if path:
                os.unlink(path)

    def _tags(self, tag: str | None) -> list[str]:
        if tag is not None:
            return [tag]
        return sorted({t for t, _ in self._owners.values()} | set(self._paused))


def _view(ptr: int, size: int) -> memoryview:
    return memoryview((ctypes.c_char * size).from_address(ptr)).cast("B")


def _release(ptr: int, size: int) -> None:
    """Zero the bytes, returning whole pages to the kernel (the partial end pages may hold other
    allocations, so they are zeroed in place)."""
    start, end = -(-ptr // _PAGE) * _PAGE, (ptr + size) // _PAGE * _PAGE
    if end <= start:
        ctypes.memset(ptr, 0, size)
        return
    ctypes.memset(ptr, 0, start - ptr)
    ctypes.memset(end, 0, ptr + size - end)
    if _libc.madvise(start, end - start, _MADV_DONTNEED) != 0:
        raise OSError(ctypes.get_errno(), f"madvise(MADV_DONTNEED) failed at {start:#x}")


@contextmanager
def configure_subprocess() -> Iterator[None]:
    """The CUDA package preloads its allocator hook into subprocesses; nothing to do here."""
    yield


torch_memory_saver = TorchMemorySaver()
