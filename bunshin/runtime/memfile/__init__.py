"""Rewrite a CRIU dump so that its restores share memory copy-on-write.

For each dumped process, every private anonymous area that has pages in the
image, and every private file mapping the process wrote to (library ``.data``
and RELRO segments: ``filemaps``), is written into a sparse *memory file* on
tmpfs (one file per process and rewrite) and turned into a private mapping of
that file; its pages leave the image. Each restore then maps the file
``MAP_PRIVATE``: all clones read the one copy in the page cache, and a write
copies a single page into the writer. Pages that are all zeros are not stored:
they stay holes, which read as zeros.

Layout: every converted area gets its own slot in the file, followed by
``growth_room`` bytes of hole, so ``mremap`` growth (in place or moved) reads
zeros, as it would in anonymous memory, never a neighbour's bytes. The kernel
merges adjacent anonymous mmaps into one area, so areas are first cut at glibc
mmapped-chunk boundaries (``realloc`` grows such a chunk with ``mremap``). Slots
keep the area's address modulo 2 MiB, so a tmpfs mounted with ``huge=`` can use
huge pages. A memory file never changes once written (mode 0444 and, where the
filesystem allows, the immutable flag): CRIU checks only its size. It must
outlive every dump and clone that maps it (``referenced_memfiles``); delete it
with ``remove_memfile``. Its pages are charged to the memory cgroup of whoever
wrote or first faulted them, not to the clones.

Forks of forks: a clone's memory is already file-backed, so CRIU dumps only the
pages the clone wrote (a *delta*, kept in the image and restored privately into
each clone); those areas keep pointing at their memory file. New areas are
converted into a new file. Large deltas are folded into a fresh file
(``rebase``).

Semantic differences from anonymous memory, and how they are handled:

- ``MADV_DONTNEED`` on a converted area brings back the file's bytes (the
  dump-time contents), not zeros (for a converted file mapping: the dump-time
  contents, not the original file's). glibc's malloc never relies on zeros
  there (``calloc`` clears everything below a heap's ``mprotect_size``; memory
  above it was never written, so the file holds a hole). jemalloc does rely on
  it, and so may mimalloc: see ``zerofill`` and ``ZeroFillPolicy``. ``COPY``
  (default) leaves such a process's anonymous memory anonymous (plain CRIU copy:
  correct, not shared), ``REFUSE`` raises ``NotForkable``, ``CONVERT`` converts
  it anyway. Its written file mappings are converted in any case.
- ``MADV_FREE`` fails with EINVAL on a converted area (callers fall back).
- A clone's first touch of a hole (memory never written before the dump, a
  page of zeros, growth room) allocates a zero page in the shared file, once
  for all clones.
- ``[heap]`` stays anonymous unless ``convert_heap``: converting it loses the
  label and mixes brk shrink/regrow with a file mapping.
- Only plain private areas are converted (see ``plan.convertible`` and
  ``filemaps.convertible_file_map``): stacks (``MAP_GROWSDOWN``),
  ``MAP_DROPPABLE``, hugetlb, vdso/vvar/vsyscall, shared and SysV memory,
  executable file mappings and areas with ``MADV_WIPEONFORK`` stay as they are.
- ``/proc/PID/maps`` shows the memory file's name for converted areas (a
  library's data segment no longer shows the library's name).

Modules: ``criu_images`` (CRIU image I/O, page maps cut at VMA boundaries),
``fileio`` (page copies with holes, sealing, safe opens), ``zerofill`` (which
processes rely on zero-fill), ``filemaps`` (which file mappings convert, their
files), ``plan`` (what becomes of each area), ``rebasing`` (folding deltas),
``rewrite`` (writing files and images, all or nothing).
"""

from bunshin.errors import NotForkable

from .criu_images import PAGE, SUFFIX, referenced_memfiles
from .fileio import (
    data_extents,
    remove_memfile,
    remove_memfile_at,
    remove_memfiles,
    set_immutable,
    unsealed,
)
from .rewrite import (
    DEFAULT_GROWTH_ROOM,
    HUGE,
    MemFile,
    RewriteResult,
    Unconverted,
    rebase,
    rewrite_images,
)
from .zerofill import ZeroFillPolicy, zero_fill_risks

__all__ = [
    "data_extents",
    "remove_memfile_at",
    "set_immutable",
    "unsealed",
    "DEFAULT_GROWTH_ROOM",
    "HUGE",
    "PAGE",
    "SUFFIX",
    "MemFile",
    "NotForkable",
    "RewriteResult",
    "Unconverted",
    "ZeroFillPolicy",
    "rebase",
    "referenced_memfiles",
    "remove_memfile",
    "remove_memfiles",
    "rewrite_images",
    "zero_fill_risks",
]
