/*
 * The SIGSYS handler a rewrite adds to each converted process (see trap.py).
 *
 * Built with gcc -nostdlib -fPIC -O2 into one position-independent blob: no
 * libc, raw syscalls only, no writable globals. The blob is mapped r-x at a free
 * address; right after its code lie a read-only TABLE (written by the rewrite
 * for each dump) and a private writable STATE page (the program's own SIGSYS
 * action). A seccomp filter returns SECCOMP_RET_TRAP (data TRAP_DATA) for the
 * calls whose semantics differ on converted memory; this handler makes them
 * exact, then issues the real call (the filter lets calls made from this code
 * through) and puts its result in the interrupted context.
 *
 *   madvise DONTNEED / DONTNEED_LOCKED: converted anonymous memory becomes
 *     fresh anonymous memory (zeros); a converted private file mapping maps its
 *     file again at its offset (the file's bytes).
 *   madvise FREE: converted anonymous memory becomes fresh anonymous memory.
 *   madvise WIPEONFORK, mremap: converted anonymous memory becomes anonymous
 *     memory holding the same bytes (pages of zeros are left as holes).
 *   rt_sigaction(SIGSYS): kept in STATE; traps that are not ours go to it (in a
 *     vfork child, which shares STATE with its parent, it is ignored: exec follows).
 *   rt_sigaction's sa_mask: SIGSYS is taken out of what gets blocked; a mask given
 *     with SIGSYS is kept in STATE and read back as given.
 *   rt_sigprocmask: a trap while SIGSYS is blocked would kill the process (the
 *     kernel resets a blocked forced SIGSYS to its default action), so the kernel
 *     never blocks it; a thread that asks to block it gets a slot in STATE (by tid)
 *     and reads its mask back with SIGSYS. A SIGSYS sent to a thread that blocks it
 *     this way is held in STATE (the thread's, or the process's for a kill) until
 *     the thread unblocks it (then raised again: the program's action gets a
 *     tgkill's siginfo); rt_sigpending shows it.
 *   execve, execveat: the thread's SIGSYS block (and a held SIGSYS, as pending)
 *     made real first, so the new program starts with the mask the program set.
 *   clone without CLONE_VM and without a new stack (fork): issued here, so the
 *     child's STATE keeps only the forking thread's slot, under the child's tid.
 */
#include <stddef.h>
#include <stdint.h>

#define NR_READ 0
#define NR_CLOSE 3
#define NR_MMAP 9
#define NR_MPROTECT 10
#define NR_MUNMAP 11
#define NR_RT_SIGACTION 13
#define NR_RT_SIGPROCMASK 14
#define NR_MREMAP 25
#define NR_CLONE 56
#define NR_EXECVE 59
#define NR_RT_SIGPENDING 127
#define NR_MADVISE 28
#define NR_GETPID 39
#define NR_GETTID 186
#define NR_TGKILL 234
#define NR_OPENAT 257
#define NR_EXECVEAT 322
#define NR_KCMP 312
#define NR_IOCTL 16
#define PROCMAP_QUERY 0xC0686611UL
#define Q_COVERING_OR_NEXT 0x10
#define Q_FILE_BACKED 0x20
#define ENOTTY 25
#define ENAMETOOLONG 36
#define ENOMEM 12
#define KCMP_VM 1
#define SIG_BLOCK 0
#define SIG_UNBLOCK 1
#define SIG_SETMASK 2
#define HOW_NONE 99 /* refused (EINVAL) after set is read */
#define SI_TKILL (-6)
#define ESRCH 3
#define SIGSYS_BIT (1UL << (SIGSYS - 1))

#define MADV_DONTNEED 4
#define MADV_FREE 8
#define MADV_WIPEONFORK 18
#define MADV_DONTNEED_LOCKED 24
#define MAP_PRIVATE 0x02
#define MAP_FIXED 0x10
#define MAP_ANONYMOUS 0x20
#define MREMAP_MAYMOVE 1
#define MREMAP_FIXED 2
#define PROT_READ 1
#define PROT_WRITE 2
#define PROT_EXEC 4
#define SIGSYS 31
#define SYS_SECCOMP 1
#define SA_SIGINFO 4
#define SA_RESETHAND 0x80000000UL
#define SIG_DFL 0
#define SIG_IGN 1
#define O_RDONLY 0
#define O_CLOEXEC 02000000
#define AT_FDCWD (-100)
#define EINVAL 22
#define EFAULT 14
#define PAGE 4096UL

#define MAGIC 0x50415254534e5542ULL /* "BUNSTRAP" */
#define VERSION 1
#define TRAP_DATA 0x6b5

/* ucontext: greg indices (x86-64 sigcontext order); the mask sigreturn restores */
#define UC_GREGS 40
#define UC_SIGMASK 296
enum { R_R8 = 0, R_R9, R_R10, R_R11, R_R12, R_R13, R_R14, R_R15, R_RDI, R_RSI, R_RBP,
       R_RBX, R_RDX, R_RAX, R_RCX, R_RSP, R_RIP };

struct ksigaction {
    uint64_t handler, flags, restorer, mask;
};

struct fent { /* a converted private file mapping: what DONTNEED brings back */
    uint64_t start, end, off; /* [start, end) maps path at off */
    char path[232];
};

struct table {
    uint64_t magic;
    uint32_t version, nfile;
    uint64_t blob_lo, blob_hi; /* this blob: never treated as converted memory */
    char view[112];            /* converted memory maps files under this prefix */
    struct fent files[];
};

#define NTHREAD 384 /* threads that block SIGSYS at once (STATE is one page) */
#define T_BLOCKS 1u /* the thread's mask holds SIGSYS (the kernel's does not) */
#define T_HELD 2u   /* a SIGSYS sent to the thread while it blocked it */

struct tslot {
    int32_t tid; /* 0: free */
    uint32_t flags;
};

struct state {
    uint64_t magic;
    struct ksigaction prog; /* the program's SIGSYS action */
    int64_t owner;          /* the process whose memory this is (a vfork child shares it) */
    uint64_t held;          /* signals (bit sig - 1) whose action's mask held SIGSYS ... */
    uint64_t masks[64];     /* ... and those masks as the program gave them */
    uint64_t shared_held;   /* a SIGSYS sent to the process while the thread given it blocked it */
    struct tslot threads[NTHREAD];
};

extern char __blob_start[] __attribute__((visibility("hidden")));
extern char __code_end[] __attribute__((visibility("hidden")));
#define TABLE_SIZE (64 * 1024UL)
#define TABLE ((const struct table *)__code_end)
#define STATE ((struct state *)(__code_end + TABLE_SIZE))

static inline long sys6(long n, long a, long b, long c, long d, long e, long f) {
    register long r10 __asm__("r10") = d;
    register long r8 __asm__("r8") = e;
    register long r9 __asm__("r9") = f;
    long ret;
    __asm__ volatile("syscall"
                     : "=a"(ret)
                     : "a"(n), "D"(a), "S"(b), "d"(c), "r"(r10), "r"(r8), "r"(r9)
                     : "rcx", "r11", "memory");
    return ret;
}
#define sys(n, a, b, c) sys6(n, (long)(a), (long)(b), (long)(c), 0, 0, 0)

/* the restorer of our sigaction: the kernel returns into it */
__asm__(".text\n.globl bunshin_sigsys_restorer\n.hidden bunshin_sigsys_restorer\n"
        "bunshin_sigsys_restorer:\n\tmov $15, %eax\n\tsyscall\n\thlt\n");

static int prefix(const char *s, const char *p) {
    while (*p)
        if (*s++ != *p++)
            return 0;
    return 1;
}

static uint64_t hex(const char **s) {
    uint64_t v = 0;
    for (;; (*s)++) {
        char c = **s;
        if (c >= '0' && c <= '9')
            v = v * 16 + (uint64_t)(c - '0');
        else if (c >= 'a' && c <= 'f')
            v = v * 16 + (uint64_t)(c - 'a' + 10);
        else
            return v;
    }
}

struct area {
    uint64_t start, end;
    int prot;
    int converted;
};

static int is_converted(const char *name, uint64_t start, uint64_t end) {
    const struct table *t = TABLE;
    return name[0] == '/' && prefix(name, t->view) && !(start < t->blob_hi && end > t->blob_lo);
}

/* parse one /proc/self/maps line */
static void parse(const char *l, struct area *a) {
    a->start = hex(&l);
    l++;
    a->end = hex(&l);
    l++;
    a->prot = (l[0] == 'r' ? PROT_READ : 0) | (l[1] == 'w' ? PROT_WRITE : 0) |
              (l[2] == 'x' ? PROT_EXEC : 0);
    a->converted = 0;
    for (int field = 0; field < 4 && *l; field++) { /* perms, offset, dev, inode */
        while (*l && *l != ' ')
            l++;
        while (*l == ' ')
            l++;
    }
    a->converted = is_converted(l, a->start, a->end);
}

typedef long (*area_fn)(const struct area *, uint64_t a, uint64_t b, int advice);

/* the text of /proc/self/maps, walked line by line (kernels without PROCMAP_QUERY) */
static long each_converted_text(long fd, uint64_t lo, uint64_t hi, area_fn fn, int advice) {
    char buf[2048], line[320];
    size_t n = 0, have = 0, pos = 0;
    long ret = 0;
    for (;;) {
        if (pos == have) {
            long r = sys(NR_READ, fd, buf, sizeof buf);
            if (r <= 0)
                break;
            have = (size_t)r;
            pos = 0;
        }
        char c = buf[pos++];
        if (c != '\n') {
            if (n < sizeof line - 1)
                line[n++] = c;
            continue;
        }
        line[n] = 0;
        n = 0;
        struct area a;
        parse(line, &a);
        if (a.start >= hi)
            break;
        if (!a.converted || a.end <= lo)
            continue;
        ret = fn(&a, a.start > lo ? a.start : lo, a.end < hi ? a.end : hi, advice);
        if (ret < 0)
            break;
    }
    return ret;
}

struct procmap_query { /* linux/fs.h, PROCMAP_QUERY (Linux >= 6.11) */
    uint64_t size, query_flags, query_addr, vma_start, vma_end, vma_flags, vma_page_size;
    uint64_t vma_offset, inode;
    uint32_t dev_major, dev_minor, vma_name_size, build_id_size;
    uint64_t vma_name_addr, build_id_addr;
};

/*
 * Call fn for the part of each converted area inside [lo, hi). Areas are found
 * with PROCMAP_QUERY (file-backed areas only, one ioctl each); on an older kernel
 * /proc/self/maps is read in chunks into a small stack buffer (a long line is cut;
 * only its start matters). Each fn call only replaces the mapping it is given,
 * which later areas do not overlap.
 */
static long each_converted(uint64_t lo, uint64_t hi, area_fn fn, int advice) {
    long fd = sys(NR_OPENAT, AT_FDCWD, "/proc/self/maps", O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return fd;
    long ret = 0;
    char name[160];
    uint64_t at = lo;
    while (at < hi) {
        struct procmap_query q = {0};
        q.size = sizeof q;
        q.query_flags = Q_COVERING_OR_NEXT | Q_FILE_BACKED;
        q.query_addr = at;
        q.vma_name_addr = (uint64_t)name;
        q.vma_name_size = sizeof name;
        long r = sys(NR_IOCTL, fd, PROCMAP_QUERY, &q);
        if (r == -ENAMETOOLONG) { /* longer than any memory file's name: not converted */
            q.vma_name_addr = 0;
            q.vma_name_size = 0;
            r = sys(NR_IOCTL, fd, PROCMAP_QUERY, &q);
        }
        if (r == -ENOTTY || r == -EINVAL) {
            ret = each_converted_text(fd, lo, hi, fn, advice);
            break;
        }
        if (r < 0 || q.vma_start >= hi)
            break; /* ENOENT: no area after */
        if (!q.vma_name_size)
            name[0] = 0;
        name[sizeof name - 1] = 0;
        if (is_converted(name, q.vma_start, q.vma_end)) {
            struct area a = {q.vma_start, q.vma_end, (int)(q.vma_flags & 7), 1};
            ret = fn(&a, a.start > lo ? a.start : lo, a.end < hi ? a.end : hi, advice);
            if (ret < 0)
                break;
        }
        at = q.vma_end;
    }
    sys(NR_CLOSE, fd, 0, 0);
    return ret;
}

static const struct fent *file_of(uint64_t addr) {
    const struct table *t = TABLE;
    for (uint32_t i = 0; i < t->nfile; i++)
        if (t->files[i].start <= addr && addr < t->files[i].end)
            return &t->files[i];
    return 0;
}

/* the first file entry starting in (a, b), or b */
static uint64_t next_file(uint64_t a, uint64_t b) {
    const struct table *t = TABLE;
    uint64_t next = b;
    for (uint32_t i = 0; i < t->nfile; i++)
        if (t->files[i].start > a && t->files[i].start < next)
            next = t->files[i].start;
    return next;
}

static long zero_map(uint64_t a, uint64_t b, int prot) {
    long r = sys6(NR_MMAP, (long)a, (long)(b - a), prot, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED, -1, 0);
    return r < 0 ? r : 0;
}

static long file_map(const struct fent *f, uint64_t a, uint64_t b, int prot) {
    long fd = sys(NR_OPENAT, AT_FDCWD, f->path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return 0; /* the file is gone: its dump-time bytes stay */
    long r = sys6(NR_MMAP, (long)a, (long)(b - a), prot, MAP_PRIVATE | MAP_FIXED, fd,
                  (long)(f->off + (a - f->start)));
    sys(NR_CLOSE, fd, 0, 0);
    return r < 0 ? r : 0;
}

/* anonymous memory holding what [a, b) holds; pages of zeros stay holes */
static long anonymize(uint64_t a, uint64_t b, int prot) {
    uint64_t n = b - a;
    long s = sys6(NR_MMAP, 0, (long)n, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (s < 0)
        return s;
    if (!(prot & PROT_READ))
        sys(NR_MPROTECT, a, n, prot | PROT_READ);
    for (uint64_t off = 0; off < n; off += PAGE) {
        const volatile uint64_t *src = (const volatile uint64_t *)(a + off);
        size_t i = 0;
        while (i < PAGE / 8 && src[i] == 0)
            i++;
        if (i == PAGE / 8)
            continue;
        volatile uint64_t *dst = (volatile uint64_t *)((uint64_t)s + off);
        for (i = 0; i < PAGE / 8; i++)
            dst[i] = src[i];
    }
    if (prot != (PROT_READ | PROT_WRITE))
        sys(NR_MPROTECT, s, n, prot);
    long r = sys6(NR_MREMAP, s, (long)n, (long)n, MREMAP_MAYMOVE | MREMAP_FIXED, (long)a, 0);
    if (r < 0) {
        sys(NR_MUNMAP, s, n, 0);
        if (!(prot & PROT_READ))
            sys(NR_MPROTECT, a, n, prot);
        return r;
    }
    return 0;
}

/* one converted area's part [a, b) before the real call with this advice */
static long prepare(const struct area *ar, uint64_t a, uint64_t b, int advice) {
    while (a < b) {
        const struct fent *f = file_of(a);
        uint64_t end = f ? (f->end < b ? f->end : b) : next_file(a, b);
        long r = 0;
        if (f) {
            if (advice == MADV_DONTNEED || advice == MADV_DONTNEED_LOCKED)
                r = file_map(f, a, end, ar->prot);
            /* FREE, WIPEONFORK on a file mapping: the real call refuses, as it would */
        } else if (advice == MADV_DONTNEED || advice == MADV_DONTNEED_LOCKED || advice == MADV_FREE) {
            r = zero_map(a, end, ar->prot);
        } else {
            r = anonymize(a, end, ar->prot);
        }
        if (r < 0)
            return r;
        a = end;
    }
    return 0;
}

#define MREMAP_PREP (-1)

/*
 * DONTNEED: the real call first, so that what it refuses (EINVAL: a locked area,
 * bad input) is refused as it would be and nothing changes; a hole in the range
 * (ENOMEM) still lets it act on the rest. The others cannot go first: on a file
 * mapping the kernel refuses them.
 */
static long do_madvise(uint64_t addr, uint64_t len, int advice) {
    uint64_t rlen = (len + PAGE - 1) & ~(PAGE - 1);
    int valid = !(addr & (PAGE - 1)) && len && rlen >= len && addr + rlen > addr;
    if (advice == MADV_DONTNEED || advice == MADV_DONTNEED_LOCKED) {
        long r = sys(NR_MADVISE, addr, len, advice);
        if ((r < 0 && r != -ENOMEM) || !valid)
            return r;
        long p = each_converted(addr, addr + rlen, prepare, advice);
        return p < 0 ? p : r;
    }
    if (valid) {
        long r = each_converted(addr, addr + rlen, prepare, advice);
        if (r < 0)
            return r;
    }
    return sys(NR_MADVISE, addr, len, advice); /* invalid input: the kernel's own answer */
}

static long do_mremap(const long *g) {
    uint64_t addr = (uint64_t)g[R_RDI], old_len = (uint64_t)g[R_RSI];
    uint64_t rlen = (old_len + PAGE - 1) & ~(PAGE - 1);
    if (!(addr & (PAGE - 1)) && old_len && addr + rlen > addr) {
        long r = each_converted(addr, addr + rlen, prepare, MREMAP_PREP);
        if (r < 0)
            return r;
    }
    return sys6(NR_MREMAP, g[R_RDI], g[R_RSI], g[R_RDX], g[R_R10], g[R_R8], 0);
}

/* a fork() child has its own copy of STATE; a vfork child shares its parent's */
static int vfork_child(long *pid) {
    *pid = sys(NR_GETPID, 0, 0, 0);
    return *pid != STATE->owner && sys6(NR_KCMP, *pid, STATE->owner, KCMP_VM, 0, 0, 0) == 0;
}

/*
 * Another signal's action: the kernel's mask never holds SIGSYS; one the program gave
 * with SIGSYS is kept in STATE and read back (act and old may be the same memory).
 */
static long other_sigaction(const long *g, const struct ksigaction *act, struct ksigaction *old) {
    struct state *st = STATE;
    long sig = g[R_RDI], pid;
    uint64_t bit = sig >= 1 && sig <= 64 ? 1UL << (sig - 1) : 0;
    int had = (st->held & bit) != 0;
    uint64_t was = had ? st->masks[sig - 1] : 0;
    if (!act) {
        long r = sys6(NR_RT_SIGACTION, sig, 0, (long)old, 8, 0, 0);
        if (r == 0 && old && had)
            old->mask = was;
        return r;
    }
    struct ksigaction mine = *act; /* (read before the call writes old) */
    uint64_t want = mine.mask;
    mine.mask &= ~SIGSYS_BIT;
    long r = sys6(NR_RT_SIGACTION, sig, (long)&mine, (long)old, 8, 0, 0);
    if (r != 0)
        return r;
    if (old && had)
        old->mask = was;
    if (bit && !vfork_child(&pid)) {
        st->held = want & SIGSYS_BIT ? st->held | bit : st->held & ~bit;
        st->masks[sig - 1] = want & SIGSYS_BIT ? want : 0;
    }
    return 0;
}

static long do_sigaction(const long *g) {
    struct state *st = STATE;
    struct ksigaction *act = (struct ksigaction *)g[R_RSI], *old = (struct ksigaction *)g[R_RDX];
    if (g[R_R10] != 8)
        return -EINVAL;
    if ((int)g[R_RDI] != SIGSYS)
        return other_sigaction(g, act, old);
    struct ksigaction prev = st->prog;
    long pid;
    int shared = vfork_child(&pid);
    if (act && !shared) {
        st->owner = pid;
        st->prog = *act;
        st->prog.mask &= ~SIGSYS_BIT;
    }
    if (old)
        *old = prev;
    return 0;
}

/* ------------------------------------------------------------ each thread's SIGSYS block */

_Static_assert(sizeof(struct state) <= 4096, "STATE is one page");

static struct tslot *slot_of(int32_t tid) {
    struct state *st = STATE;
    for (int i = 0; i < NTHREAD; i++)
        if (__atomic_load_n(&st->threads[i].tid, __ATOMIC_ACQUIRE) == tid)
            return &st->threads[i];
    return 0;
}

static uint32_t flags_of(int32_t tid) {
    struct tslot *t = slot_of(tid);
    return t ? t->flags : 0;
}

/* free the slots of tids that are no thread of this process (exited, or a vfork child's; in a
   vfork child: of its parent's, whose STATE it is) */
static void purge(void) {
    struct state *st = STATE;
    long pid;
    if (vfork_child(&pid))
        pid = st->owner;
    for (int i = 0; i < NTHREAD; i++) {
        int32_t tid = __atomic_load_n(&st->threads[i].tid, __ATOMIC_ACQUIRE);
        if (tid && sys(NR_TGKILL, pid, tid, 0) == -ESRCH)
            __atomic_compare_exchange_n(&st->threads[i].tid, &tid, 0, 0, __ATOMIC_ACQ_REL, __ATOMIC_RELAXED);
    }
}

/* the calling thread's flags (only it writes its slot; a slot is taken by compare-and-swap) */
static int set_flags(int32_t tid, uint32_t flags) {
    struct state *st = STATE;
    struct tslot *t = slot_of(tid);
    if (t || !flags) {
        if (t) {
            t->flags = flags;
            if (!flags)
                __atomic_store_n(&t->tid, 0, __ATOMIC_RELEASE);
        }
        return 1;
    }
    for (int pass = 0; pass < 2; pass++, purge())
        for (int i = 0; i < NTHREAD; i++) {
            int32_t free = 0;
            if (__atomic_compare_exchange_n(&st->threads[i].tid, &free, tid, 0, __ATOMIC_ACQ_REL,
                                            __ATOMIC_RELAXED)) {
                st->threads[i].flags = flags;
                return 1;
            }
        }
    return 0; /* NTHREAD threads block SIGSYS: this one reads its mask back without it */
}

static int32_t my_tid(void) {
    return (int32_t)sys(NR_GETTID, 0, 0, 0);
}

/* a held SIGSYS (the thread's or the process's), taken: it is to be raised again */
static int take_held(int32_t tid, uint32_t *flags) {
    int any = (*flags & T_HELD) != 0;
    *flags &= ~T_HELD;
    return __atomic_exchange_n(&STATE->shared_held, 0, __ATOMIC_ACQ_REL) != 0 || any;
}

/*
 * The mask the program asks for goes into the interrupted context: sigreturn sets
 * it (a mask set by a real call here would be undone by sigreturn). The kernel
 * reads set, checks how, changes the mask, then writes old: so does this. The real
 * calls only check the pointers and change nothing: set is read before how is
 * refused, old gets the current mask (overwritten with the program's).
 */
static long do_sigprocmask(const long *g, void *uc) {
    const uint64_t *set = (const uint64_t *)g[R_RSI];
    uint64_t *old = (uint64_t *)g[R_RDX];
    uint64_t *mask = (uint64_t *)((char *)uc + UC_SIGMASK);
    if (g[R_R10] != 8)
        return -EINVAL;
    int32_t tid = my_tid();
    uint32_t flags = flags_of(tid);
    uint64_t cur = *mask | (flags & T_BLOCKS ? SIGSYS_BIT : 0), want = cur;
    if (set) {
        long r = sys6(NR_RT_SIGPROCMASK, HOW_NONE, (long)set, 0, 8, 0, 0);
        if (r == -EFAULT)
            return r;
        if (g[R_RDI] == SIG_BLOCK)
            want = cur | *set;
        else if (g[R_RDI] == SIG_UNBLOCK)
            want = cur & ~*set;
        else if (g[R_RDI] == SIG_SETMASK)
            want = *set;
        else
            return -EINVAL;
        want &= ~((1UL << 8) | (1UL << 18)); /* nor SIGKILL, SIGSTOP */
        flags = want & SIGSYS_BIT ? flags | T_BLOCKS : flags & ~T_BLOCKS;
        int again = !(flags & T_BLOCKS) && take_held(tid, &flags);
        set_flags(tid, flags);
        *mask = want & ~SIGSYS_BIT;
        if (again) /* delivered at once (SIGSYS is not blocked in here): as an unblock does */
            sys(NR_TGKILL, sys(NR_GETPID, 0, 0, 0), tid, SIGSYS);
    }
    if (old) {
        long r = sys6(NR_RT_SIGPROCMASK, SIG_BLOCK, 0, (long)old, 8, 0, 0);
        if (r < 0)
            return r;
        *old = cur;
    }
    return 0;
}

/* what the kernel has pending, and a SIGSYS held back */
static long do_sigpending(const long *g) {
    long r = sys(NR_RT_SIGPENDING, g[R_RDI], g[R_RSI], 0);
    if (r == 0 && g[R_RSI] == 8 && ((flags_of(my_tid()) & T_HELD) || __atomic_load_n(&STATE->shared_held, __ATOMIC_ACQUIRE)))
        *(uint64_t *)g[R_RDI] |= SIGSYS_BIT;
    return r;
}

/* the thread's SIGSYS block made real for the new program (undone if exec fails) */
static long do_exec(int nr, const long *g) {
    int32_t tid = my_tid();
    uint32_t flags = flags_of(tid);
    uint64_t bit = SIGSYS_BIT;
    int blocks = (flags & T_BLOCKS) != 0;
    if (blocks) { /* the slot goes (a vfork child's would outlive it), SIGSYS blocked for real */
        set_flags(tid, 0);
        sys6(NR_RT_SIGPROCMASK, SIG_BLOCK, (long)&bit, 0, 8, 0, 0);
        if (take_held(tid, &flags)) /* pending signals outlive exec: so does this one */
            sys(NR_TGKILL, sys(NR_GETPID, 0, 0, 0), tid, SIGSYS);
    }
    long r = sys6(nr, g[R_RDI], g[R_RSI], g[R_RDX], g[R_R10], g[R_R8], g[R_R9]);
    if (blocks) { /* still here: exec failed; the SIGSYS now pending arrives and is held again */
        set_flags(tid, flags);
        sys6(NR_RT_SIGPROCMASK, SIG_UNBLOCK, (long)&bit, 0, 8, 0, 0);
    }
    return r;
}

/* fork: the child's STATE is a copy; it keeps the forking thread's block under its tid */
static long do_fork(const long *g) {
    struct state *st = STATE;
    uint32_t flags = flags_of(my_tid()) & T_BLOCKS; /* a fork's child has nothing pending */
    long r = sys6(NR_CLONE, g[R_RDI], g[R_RSI], g[R_RDX], g[R_R10], g[R_R8], 0);
    if (r == 0) {
        st->owner = sys(NR_GETPID, 0, 0, 0);
        st->shared_held = 0;
        for (int i = 0; i < NTHREAD; i++)
            st->threads[i].tid = 0;
        set_flags(my_tid(), flags);
    }
    return r;
}

/* a SIGSYS that is not our trap: what the program's own action would do */
static void chain(int sig, void *info, void *uc, int seccomp) {
    struct state *st = STATE;
    struct ksigaction p = st->prog;
    if (p.handler == SIG_IGN && !seccomp)
        return;
    if (p.handler == SIG_DFL || p.handler == SIG_IGN) {
        /* default action (a seccomp trap is never ignored): die by SIGSYS on return */
        struct ksigaction dfl = {SIG_DFL, 0, 0, 0};
        sys6(NR_RT_SIGACTION, SIGSYS, (long)&dfl, 0, 8, 0, 0);
        sys(NR_TGKILL, sys(NR_GETPID, 0, 0, 0), sys(NR_GETTID, 0, 0, 0), SIGSYS);
        return;
    }
    if (p.flags & SA_RESETHAND)
        st->prog.handler = SIG_DFL;
    uint64_t mask = p.mask, saved;
    sys6(NR_RT_SIGPROCMASK, 0 /* SIG_BLOCK */, (long)&mask, (long)&saved, 8, 0, 0);
    if (p.flags & SA_SIGINFO)
        ((void (*)(int, void *, void *))p.handler)(sig, info, uc);
    else
        ((void (*)(int))p.handler)(sig);
    sys6(NR_RT_SIGPROCMASK, 2 /* SIG_SETMASK */, (long)&saved, 0, 8, 0, 0);
}

/*
 * A SIGSYS that is not our trap, sent while the thread blocks SIGSYS: held (a
 * seccomp trap of the program's own filter is never held: it kills, as the kernel
 * does when SIGSYS is blocked). 1 if it was held.
 */
static int hold(const int *si, int seccomp) {
    int32_t tid = my_tid();
    uint32_t flags = flags_of(tid);
    if (!(flags & T_BLOCKS))
        return 0;
    if (seccomp) { /* the kernel resets a blocked forced SIGSYS to its default action */
        STATE->prog.handler = SIG_DFL;
        return 0;
    }
    if (si[2] == SI_TKILL)
        set_flags(tid, flags | T_HELD);
    else
        __atomic_store_n(&STATE->shared_held, 1, __ATOMIC_RELEASE);
    return 1;
}

void bunshin_sigsys(int sig, void *info, void *uc) {
    const int *si = (const int *)info; /* si_signo, si_errno, si_code */
    int seccomp = si[2] == SYS_SECCOMP;
    if (!seccomp || si[1] != TRAP_DATA || TABLE->magic != MAGIC) {
        if (!hold(si, seccomp))
            chain(sig, info, uc, seccomp);
        return;
    }
    long *g = (long *)((char *)uc + UC_GREGS);
    int nr = *(const int *)((const char *)info + 24); /* si_syscall */
    long ret;
    if (nr == NR_MADVISE)
        ret = do_madvise((uint64_t)g[R_RDI], (uint64_t)g[R_RSI], (int)g[R_RDX]);
    else if (nr == NR_MREMAP)
        ret = do_mremap(g);
    else if (nr == NR_RT_SIGACTION)
        ret = do_sigaction(g);
    else if (nr == NR_RT_SIGPROCMASK)
        ret = do_sigprocmask(g, uc);
    else if (nr == NR_RT_SIGPENDING)
        ret = do_sigpending(g);
    else if (nr == NR_EXECVE || nr == NR_EXECVEAT)
        ret = do_exec(nr, g);
    else if (nr == NR_CLONE)
        ret = do_fork(g);
    else /* not one we trap: issue it as it was */
        ret = sys6(nr, g[R_RDI], g[R_RSI], g[R_RDX], g[R_R10], g[R_R8], g[R_R9]);
    g[R_RAX] = ret;
}
