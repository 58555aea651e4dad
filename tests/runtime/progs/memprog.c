/*
 * memprog: a workload for the copy-on-write fork tests.
 *
 *   memprog CTL_DIR HEAP_MIB THREADS CHILDREN
 *
 * Holds a HEAP_MIB glibc-mmapped block, an 8 MiB block to grow with realloc
 * (mremap), small chunks in the main arena ([heap]) and 16 MiB of 64 KiB
 * chunks in each of THREADS thread arenas, all filled with patterns. CHILDREN
 * forked copies run the same command loop (without worker threads).
 *
 * Commands: sum, write OFF_MIB LEN_MIB BYTE, touch FIRST_PAGE N, alloc MIB,
 * arena, zero, mremap NEW_MIB, dontneed, lib, lfill OFF_KIB LEN_KIB SEED,
 * lzero OFF_KIB LEN_KIB, fmap PATH KIB BYTE, exit (see handle()).
 *
 * With MEMPROG_LIB=/path/to/libblob.so in the environment it loads that
 * library (see libblob.c); lib/lfill/lzero read and write its data.
 *
 * Protocol: the host writes one command line to CTL_DIR/<hostpid>.cmd and
 * sends SIGUSR1; the answer appears in CTL_DIR/<hostpid>.out (written to a
 * temporary name, then renamed). <hostpid> is what readlink("/proc/self")
 * says: the host's /proc, so it stays right in every clone.
 *
 * Built with -DJEMALLOC_MARK it carries jemalloc's message prefix, as a binary
 * with jemalloc linked in statically does.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <malloc.h>
#include <pthread.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#define MIB (1024UL * 1024UL)
#define NBRK 64
#define BRK_CHUNK (16 * 1024)
#define TCHUNKS 256
#define TCHUNK (64 * 1024)
#define MAXT 16

enum { W_IDLE, W_FILL, W_CYCLE };

struct worker {
    pthread_t thread;
    int id;
    int cmd;
    long stale;     /* nonzero bytes calloc returned */
    long trimmed;   /* freed chunks whose first byte read back nonzero */
    uint8_t *chunks[TCHUNKS];
};

static const char *ctl_dir;
static volatile sig_atomic_t pending;
static int is_root_proc = 1;
static uint8_t *big, *grow, *brk_chunks[NBRK];
static size_t big_len, grow_len, grow_cur;
#define MAXEXTRA 64
static uint8_t *extra[MAXEXTRA];  /* blocks allocated by "alloc", kept */
static size_t extra_len[MAXEXTRA];
static int nextra;
static int nthreads;
static struct worker workers[MAXT];
static uint8_t *lib_blob;  /* the data of MEMPROG_LIB, if loaded */
static size_t lib_len;
static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t cv = PTHREAD_COND_INITIALIZER;

#ifdef JEMALLOC_MARK
/* what a statically linked jemalloc leaves in a binary */
const char *volatile jemalloc_marker = "<jemalloc>: (test marker)";
#endif

static void on_usr1(int sig) { (void)sig; pending = 1; }

static void fill_pattern(uint8_t *p, size_t len, uint64_t seed) {
    uint64_t x = seed | 1, *w = (uint64_t *)p;
    for (size_t i = 0; i < len / 8; i++) {
        x ^= x << 13; x ^= x >> 7; x ^= x << 17;
        w[i] = x;
    }
}

static uint64_t hash(uint64_t h, const uint8_t *p, size_t len) {
    const uint64_t *w = (const uint64_t *)p;
    for (size_t i = 0; i < len / 8; i++)
        h = (h ^ w[i]) * 0x100000001b3ULL;
    return h;
}

static long count_nonzero(const uint8_t *p, size_t len) {
    long n = 0;
    for (size_t i = 0; i < len; i++)
        n += p[i] != 0;
    return n;
}

static void worker_fill(struct worker *w) {
    for (int i = 0; i < TCHUNKS; i++) {
        if (!w->chunks[i])
            w->chunks[i] = malloc(TCHUNK);
        memset(w->chunks[i], 0xA5 ^ w->id, TCHUNK);
    }
}

/* Free everything (glibc trims the arena heap with MADV_DONTNEED), then
 * calloc it back: calloc'ed memory must read as zero. */
static void worker_cycle(struct worker *w) {
    uint8_t *old[TCHUNKS];
    for (int i = TCHUNKS - 1; i >= 0; i--) {
        old[i] = w->chunks[i];
        free(w->chunks[i]);
        w->chunks[i] = NULL;
    }
    w->trimmed = 0;
    for (int i = 0; i < TCHUNKS; i++)   /* peeks at freed, maybe trimmed memory */
        w->trimmed += *(volatile uint8_t *)(old[i] + 4096) != 0;
    w->stale = 0;
    for (int i = 0; i < TCHUNKS; i++) {
        w->chunks[i] = calloc(1, TCHUNK);
        w->stale += count_nonzero(w->chunks[i], TCHUNK);
    }
    worker_fill(w);
}

static void *worker_main(void *arg) {
    struct worker *w = arg;
    pthread_mutex_lock(&mu);
    for (;;) {
        while (w->cmd == W_IDLE)
            pthread_cond_wait(&cv, &mu);
        pthread_mutex_unlock(&mu);
        if (w->cmd == W_FILL)
            worker_fill(w);
        else
            worker_cycle(w);
        pthread_mutex_lock(&mu);
        w->cmd = W_IDLE;
        pthread_cond_broadcast(&cv);
    }
    return NULL;
}

static void run_workers(int cmd) {
    pthread_mutex_lock(&mu);
    for (int i = 0; i < nthreads; i++)
        workers[i].cmd = cmd;
    pthread_cond_broadcast(&cv);
    for (int i = 0; i < nthreads; i++)
        while (workers[i].cmd != W_IDLE)
            pthread_cond_wait(&cv, &mu);
    pthread_mutex_unlock(&mu);
}

static uint64_t threads_hash(void) {
    uint64_t h = 0xcbf29ce484222325ULL;
    for (int t = 0; t < nthreads; t++)
        for (int i = 0; i < TCHUNKS; i++)
            h = hash(h, workers[t].chunks[i], TCHUNK);
    return h;
}

/* Fresh memory of every origin must read as zero. */
static long zero_checks(void) {
    long bad = 0;
    for (size_t n = 16; n <= 256 * 1024; n *= 2) {
        uint8_t *p = calloc(1, n);
        bad += count_nonzero(p, n);
        memset(p, 0x5A, n);
        free(p);
    }
    uint8_t *p = calloc(1, 64 * MIB);
    bad += count_nonzero(p, 64 * MIB);
    free(p);
    uint8_t *m = mmap(NULL, 16 * MIB, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    bad += count_nonzero(m, 16 * MIB);
    munmap(m, 16 * MIB);
    return bad;
}

static void handle(const char *cmd, char *out, size_t outlen) {
    unsigned long a = 0, b = 0, c = 0;
    char fpath[200];
    if (!strcmp(cmd, "lib") && lib_blob) {
        snprintf(out, outlen, "addr=%p len=%zu", (void *)lib_blob, lib_len);
    } else if (sscanf(cmd, "lfill %lu %lu %lu", &a, &b, &c) == 3 && (a + b) * 1024 <= lib_len) {
        fill_pattern(lib_blob + a * 1024, b * 1024, c);
        snprintf(out, outlen, "ok");
    } else if (sscanf(cmd, "lzero %lu %lu", &a, &b) == 2 && (a + b) * 1024 <= lib_len) {
        memset(lib_blob + a * 1024, 0, b * 1024);
        snprintf(out, outlen, "ok");
    } else if (sscanf(cmd, "fmap %199s %lu %lu", fpath, &a, &c) == 3) {
        /* a private, writable mapping of a file, maybe longer than the file:
         * write every page that lies (at least partly) in the file */
        int fd = open(fpath, O_RDONLY | O_CLOEXEC);
        off_t size = fd >= 0 ? lseek(fd, 0, SEEK_END) : -1;
        uint8_t *m = fd >= 0 ? mmap(NULL, a * 1024, PROT_READ | PROT_WRITE, MAP_PRIVATE, fd, 0)
                             : MAP_FAILED;
        if (fd >= 0)
            close(fd);
        if (m == MAP_FAILED) {
            snprintf(out, outlen, "error fmap %d", errno);
        } else {
            size_t in_file = ((size_t)size + 4095) & ~(size_t)4095;
            memset(m, (int)c, in_file < a * 1024 ? in_file : a * 1024);
            snprintf(out, outlen, "addr=%p", (void *)m);
        }
    } else if (!strncmp(cmd, "sum", 3)) {
        uint64_t hb = hash(0xcbf29ce484222325ULL, big, big_len);
        uint64_t hh = 0xcbf29ce484222325ULL;
        for (int i = 0; i < NBRK; i++)
            hh = hash(hh, brk_chunks[i], BRK_CHUNK);
        hh = hash(hh, grow, grow_len);
        uint64_t he = 0xcbf29ce484222325ULL;
        for (int i = 0; i < nextra; i++)
            he = hash(he, extra[i], extra_len[i]);
        snprintf(out, outlen, "big=%016llx heap=%016llx threads=%016llx extra=%016llx",
                 (unsigned long long)hb, (unsigned long long)hh,
                 (unsigned long long)(is_root_proc ? threads_hash() : 0),
                 (unsigned long long)he);
    } else if (sscanf(cmd, "alloc %lu", &a) == 1 && nextra < MAXEXTRA) {
        /* new anonymous memory that stays: a fresh mmapped chunk */
        extra_len[nextra] = a * MIB;
        extra[nextra] = malloc(a * MIB);
        fill_pattern(extra[nextra], a * MIB, 4242 + nextra);
        nextra++;
        snprintf(out, outlen, "ok");
    } else if (sscanf(cmd, "write %lu %lu %lu", &a, &b, &c) == 3) {
        memset(big + a * MIB, (int)c, b * MIB);
        snprintf(out, outlen, "ok");
    } else if (sscanf(cmd, "touch %lu %lu", &a, &b) == 2) {
        /* write one byte in each of b pages from page a on: small scattered deltas */
        for (unsigned long i = 0; i < b; i++)
            big[(a + i * 7) % (big_len / 4096) * 4096 + 100] ^= 0xFF;
        snprintf(out, outlen, "ok");
    } else if (!strncmp(cmd, "arena", 5) && is_root_proc) {
        run_workers(W_CYCLE);
        long stale = 0, trimmed = 0;
        for (int i = 0; i < nthreads; i++) {
            stale += workers[i].stale;
            trimmed += workers[i].trimmed;
        }
        malloc_trim(0);
        snprintf(out, outlen, "stale=%ld trimmed=%ld", stale, trimmed);
    } else if (!strncmp(cmd, "zero", 4)) {
        snprintf(out, outlen, "bad=%ld", zero_checks());
    } else if (sscanf(cmd, "mremap %lu", &a) == 1 && a * MIB > grow_cur) {
        /* glibc grows an mmapped chunk with mremap (in place or moved) */
        size_t new_len = a * MIB;
        uint64_t before = hash(0xcbf29ce484222325ULL, grow, grow_len);
        uint8_t *g = realloc(grow, new_len);
        uint64_t after = hash(0xcbf29ce484222325ULL, g, grow_len);
        long tail = count_nonzero(g + grow_cur, new_len - grow_cur);
        memset(g + grow_cur, 0x3C, new_len - grow_cur);
        snprintf(out, outlen, "intact=%d tail_nonzero=%ld moved=%d",
                 before == after, tail, g != grow);
        grow = g;  /* the checksum covers the first grow_len bytes only */
        grow_cur = new_len;
    } else if (!strncmp(cmd, "dontneed", 8)) {
        /* the documented difference: MADV_DONTNEED on a converted area */
        uint8_t *page = (uint8_t *)(((uintptr_t)big + 2 * 4096) & ~(uintptr_t)4095);
        uint64_t keep[512];
        memcpy(keep, page, 4096);
        page[0] ^= 0xFF;
        madvise(page, 4096, MADV_DONTNEED);
        long nz = count_nonzero(page, 4096);
        int same = !memcmp(keep, page, 4096);
        memcpy(page, keep, 4096);
        snprintf(out, outlen, "nonzero=%ld dump_bytes=%d", nz, same);
    } else if (!strncmp(cmd, "exit", 4)) {
        exit(0);
    } else {
        snprintf(out, outlen, "error unknown command");
    }
}

static void serve_once(void) {
    char self[64], path[4096], tmp[4096], cmd[256] = "", out[512] = "";
    ssize_t n = readlink("/proc/self", self, sizeof self - 1);
    if (n <= 0)
        return;
    self[n] = 0;
    snprintf(path, sizeof path, "%s/%s.cmd", ctl_dir, self);
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return;
    n = read(fd, cmd, sizeof cmd - 1);
    close(fd);
    unlink(path);
    if (n <= 0)
        return;
    cmd[n] = 0;
    handle(cmd, out, sizeof out);
    snprintf(tmp, sizeof tmp, "%s/%s.out.tmp", ctl_dir, self);
    snprintf(path, sizeof path, "%s/%s.out", ctl_dir, self);
    fd = open(tmp, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (fd < 0)
        return;
    if (write(fd, out, strlen(out)) < 0) {
        /* nothing to do: the host times out */
    }
    close(fd);
    rename(tmp, path);
}

static void loop(void) {
    sigset_t block, old;
    sigemptyset(&block);
    sigaddset(&block, SIGUSR1);
    sigprocmask(SIG_BLOCK, &block, &old);
    sigdelset(&old, SIGUSR1);
    for (;;) {
        while (!pending)
            sigsuspend(&old);
        pending = 0;
        while (waitpid(-1, NULL, WNOHANG) > 0)
            ;
        serve_once();
    }
}

int main(int argc, char **argv) {
    if (argc < 5) {
        fprintf(stderr, "usage: memprog CTL_DIR HEAP_MIB THREADS CHILDREN\n");
        return 2;
    }
    setsid();
    ctl_dir = argv[1];
    big_len = strtoul(argv[2], NULL, 10) * MIB;
    nthreads = atoi(argv[3]);
    int children = atoi(argv[4]);
    if (nthreads > MAXT)
        nthreads = MAXT;
    const char *lib = getenv("MEMPROG_LIB");
    if (lib) {
        void *h = dlopen(lib, RTLD_NOW);
        uint8_t *end = h ? dlsym(h, "lib_blob_end") : NULL;
        lib_blob = h ? dlsym(h, "lib_blob") : NULL;
        if (!lib_blob || !end) {
            fprintf(stderr, "memprog: cannot load %s: %s\n", lib, dlerror());
            return 2;
        }
        lib_len = (size_t)(end - lib_blob);
    }

    struct sigaction sa = {0};
    sa.sa_handler = on_usr1;
    sigaction(SIGUSR1, &sa, NULL);
    signal(SIGCHLD, SIG_DFL);
    /* Only the main thread may take SIGUSR1 (in sigsuspend): worker threads inherit
     * this mask. Otherwise a signal sent while the main thread has it blocked (right
     * after a restore, say) goes to a worker and the main thread sleeps on. */
    sigset_t usr1;
    sigemptyset(&usr1);
    sigaddset(&usr1, SIGUSR1);
    sigprocmask(SIG_BLOCK, &usr1, NULL);

    big = malloc(big_len);
    fill_pattern(big, big_len, 0x1234567);
    grow_len = grow_cur = 8 * MIB;
    grow = malloc(grow_len);
    fill_pattern(grow, grow_len, 0x7654321);
    for (int i = 0; i < NBRK; i++) {
        brk_chunks[i] = malloc(BRK_CHUNK);
        fill_pattern(brk_chunks[i], BRK_CHUNK, 1000 + i);
    }
    for (int i = 0; i < nthreads; i++) {
        workers[i].id = i;
        workers[i].cmd = W_IDLE;
        pthread_create(&workers[i].thread, NULL, worker_main, &workers[i]);
    }
    run_workers(W_FILL);

    for (int i = 0; i < children; i++) {
        pid_t pid = fork();
        if (pid == 0) {
            is_root_proc = 0;
            nthreads = 0;
            break;
        }
    }
    /* tell the host we are ready: CTL_DIR/<hostpid>.ready */
    char self[64], path[4096];
    ssize_t n = readlink("/proc/self", self, sizeof self - 1);
    if (n > 0) {
        self[n] = 0;
        snprintf(path, sizeof path, "%s/%s.ready", ctl_dir, self);
        int fd = open(path, O_WRONLY | O_CREAT | O_CLOEXEC, 0644);
        if (fd >= 0)
            close(fd);
    }
    loop();
    return 0;
}
