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

Semantic differences from anonymous memory, and how they are kept exact
(``ZeroFillPolicy.TRAP``, the default; ``trap``, ``trapcode``, ``sites``, ``sigsys.c``).
In a clone, converted memory is a private mapping of a shared file, and a few calls
behave differently there: ``MADV_DONTNEED`` (and ``DONTNEED_LOCKED``) brings back the
file's dump-time bytes instead of zeros (for a converted file mapping: instead of the
file's bytes), ``mremap`` shrink-then-regrow reads old bytes, ``MADV_FREE`` and
``MADV_WIPEONFORK`` fail with EINVAL. On a stock kernel unrelated processes cannot
share anonymous pages copy-on-write, so each converted process gets a trap instead: a
SIGSYS handler (no libc, raw syscalls, mapped from its memory file with a table and a
state page), a SIGSYS action pointing at it and a seccomp filter in its chain that
returns ``SECCOMP_RET_TRAP`` for exactly those calls, made from one of the process's
dump-time system call sites (``sites``) on memory converted then. The handler finds
the converted areas (``PROCMAP_QUERY``; the maps text on kernels before 6.11), maps
fresh anonymous memory over them (DONTNEED, FREE), maps the original file again
(DONTNEED on a converted file mapping), or turns them into anonymous memory holding
the same bytes (WIPEONFORK, before ``mremap``), then issues the real call from its own
code (which the filter lets through) and returns its result. ``rt_sigaction(SIGSYS)``
is kept in the state page (traps that are not ours, and ``kill(SIGSYS)``, go to the
program's own action; a vfork child's reset is ignored), and SIGSYS is kept out of
every blocked mask (a trap while SIGSYS is blocked would kill the process). A clone's
dump holds all of it: recognised, kept, the table rewritten and the filter replaced.
Measured (``bunshin bench trap``, busy 2-core VM): a trapped DONTNEED ~5 us against
~1.5 us, a trapped ``rt_sigprocmask`` ~0.9 us against ~0.12 us.

What is left, and where the trap is refused: a process that cannot get the handler
(no free address range, too many file mappings or system call sites for the table or
BPF's 4,096 instructions, seccomp strict mode, no address randomisation, a statically
linked executable that is not position-independent) keeps its memory anonymous
(copied, exact; ``left_anonymous`` says why), or raises ``NotForkable`` with
``REFUSE``. Calls from code loaded or generated after the fork that make these system
calls directly (not through the dumped C library) are not trapped; nor are calls from
a non-PIE, dynamically linked executable's own text (Debian's python3: its calls go
through libc). A program exec'd in a clone keeps the filter but has no handler: it is
trapped only if one of its ``syscall`` instructions lands on exactly one of the dumped
sites (and, for madvise/mremap, aims at dump-time converted ranges): with ASLR about
sites_old x sites_new / 2^40 per exec (~1e-6 for two C-library processes). A program
that installs its own SIGSYS handler from code the filter does not admit, or whose own
filter traps the calls the handler makes (open, ioctl, mmap, mremap, madvise), is not
supported. A process that blocks SIGSYS at the dump in any thread (glibc's SIGEV_THREAD timer
helper blocks every signal) is not given the trap (a trap while SIGSYS is blocked kills;
unblocking it would show): its memory is copied. SIGSYS cannot be blocked after the fork in a
converted process (``sigprocmask`` reports it unblocked); an action's mask loses it in the
kernel (bash's for its terminating signals) and keeps it in the state page, where ``sigaction``
reads it back (a SIGSYS sent while that handler runs is not held back). Each DONTNEED of a separate run of converted pages adds areas
(``vm.max_map_count``). ``mremap`` of a converted *file* mapping grows into zeros, not
into the file's next bytes. ``COPY`` keeps the older heuristic without the trap (a
process mapping jemalloc/mimalloc stays anonymous: ``zerofill``), ``CONVERT``
converts without trap or heuristic (the differences above apply).
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
``fileio`` (page copies with holes, sealing, safe opens), ``zerofill`` (the policy;
which processes rely on zero-fill), ``filemaps`` (which file mappings convert, their
files), ``plan`` (what becomes of each area), ``rebasing`` (folding deltas),
``trapcode`` (the handler blob, its table, the filter), ``sites`` (system call
sites), ``trap`` (adding the trap to a process's images), ``rewrite`` (writing files
and images, all or nothing).
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
