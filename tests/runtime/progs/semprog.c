/*
 * semprog: checks the memory semantics Linux promises, in a parent and in its clones.
 *
 *   semprog CTL_DIR DATA_FILE [own|noquery]   serve commands (protocol of memprog.c)
 *   semprog child                       the checks of an exec'd program (exit 0: all held)
 *
 * Holds anonymous areas with patterns and a private mapping of DATA_FILE whose
 * first 16 KiB it wrote. With "own" it installs a SIGSYS handler and a seccomp
 * filter of its own that traps getppid() (data 0x42): the handler counts and
 * makes the call return 4242. With "noquery" its filter refuses the PROCMAP_QUERY
 * ioctl (ENOTTY, as a kernel before 6.11 does). With SEMPROG_EXEC_MAP=PATH in the environment it also
 * maps PATH executable (a hostile "code" file).
 *
 * Commands (answers are key=value words):
 *   dontneed  MADV_DONTNEED / DONTNEED_LOCKED on written anonymous pages: dn, dnl =
 *             non-zero bytes after (0 expected)
 *   mremap    shrink an 8 MiB area to 4 MiB, grow it back: tail = non-zero bytes of
 *             the regrown half, head = 1 if the first half kept its bytes
 *   free      MADV_FREE: free = its result (0), then errno
 *   wipe      MADV_WIPEONFORK: wipe = result; in a fork() child: child = non-zero bytes
 *             of the area; keep = 1 if this process kept its bytes
 *   fmap      MADV_DONTNEED on the written file mapping: file = 1 if it reads the file
 *   own       own seccomp trap and kill(SIGSYS): got = how many reached our handler (2),
 *             ret = what the trapped call returned (4242)
 *   resig     install our SIGSYS handler again (sigaction after the fork): old = 1 if
 *             sigaction reported our handler as the one before
 *   exec      fork + exec "semprog child": status = its exit status
 *   forkchild fork(): the child runs dontneed and mremap: status = its exit status
 *   spawn     posix_spawn "semprog child" (a vfork child resetting every action):
 *             status = its exit status
 *   blocked   dontneed in a thread that blocks every signal: its answer
 *   locked    MADV_DONTNEED on an mlock'ed page: errno = EINVAL (22), kept = 1 if its
 *             bytes stayed
 *   mask      block SIGUSR2 and SIGTTOU, read the mask back: kept = 1 if both are in
 *             it, then unblock: gone = 1 if neither is
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <linux/filter.h>
#include <linux/seccomp.h>
#include <pthread.h>
#include <signal.h>
#include <spawn.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/syscall.h>
#include <sys/ucontext.h>
#include <sys/wait.h>
#include <unistd.h>

#ifndef MADV_DONTNEED_LOCKED
#define MADV_DONTNEED_LOCKED 24
#endif
#define MIB (1024UL * 1024UL)
#define PAGE 4096UL
#define FILE_LEN (64 * 1024UL)
#define WRITTEN (16 * 1024UL)

static const char *ctl_dir, *data_file, *self_exe;
static volatile sig_atomic_t pending;
static volatile long own_traps;
static uint8_t *anon, *grow, *wipe, *fmap, *freed;

static void on_usr1(int sig) { (void)sig; pending = 1; }

static void on_sigsys(int sig, siginfo_t *si, void *ctx) {
    (void)sig;
    own_traps++;
    if (si->si_code == 1 /* SYS_SECCOMP */ && si->si_errno == 0x42)
        ((ucontext_t *)ctx)->uc_mcontext.gregs[REG_RAX] = 4242;
}

static long nonzero(const uint8_t *p, size_t n) {
    long c = 0;
    for (size_t i = 0; i < n; i++)
        c += p[i] != 0;
    return c;
}

static int all(const uint8_t *p, size_t n, uint8_t b) {
    for (size_t i = 0; i < n; i++)
        if (p[i] != b)
            return 0;
    return 1;
}

static uint8_t *map_anon(size_t n, int byte) {
    uint8_t *p = mmap(NULL, n, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) {
        perror("mmap");
        exit(2);
    }
    memset(p, byte, n);
    return p;
}

static void install_sigsys(void) {
    struct sigaction sa = {0};
    sa.sa_sigaction = on_sigsys;
    sa.sa_flags = SA_SIGINFO;
    sigaction(SIGSYS, &sa, NULL);
}

static void install_own_filter(void) {
    struct sock_filter f[] = {
        BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(struct seccomp_data, nr)),
        BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, SYS_getppid, 0, 1),
        BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_TRAP | 0x42),
        BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ALLOW),
    };
    struct sock_fprog prog = {sizeof f / sizeof f[0], f};
    prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0);
    if (prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, &prog)) {
        perror("seccomp");
        exit(2);
    }
}

static void install_noquery_filter(void) {
    struct sock_filter f[] = {
        BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(struct seccomp_data, nr)),
        BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, SYS_ioctl, 0, 3),
        BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(struct seccomp_data, args[1])),
        BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, 0xC0686611, 0, 1),
        BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ERRNO | ENOTTY),
        BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ALLOW),
    };
    struct sock_fprog prog = {sizeof f / sizeof f[0], f};
    prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0);
    if (prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, &prog)) {
        perror("seccomp");
        exit(2);
    }
}

static void check_dontneed(char *out, size_t len) {
    uint8_t *p = anon + 2 * PAGE, *q = anon + 5 * PAGE;
    p[0] ^= 0xFF;
    madvise(p, PAGE, MADV_DONTNEED);
    long dn = nonzero(p, PAGE);
    long dnl = madvise(q, 2 * PAGE, MADV_DONTNEED_LOCKED) ? -errno : nonzero(q, 2 * PAGE);
    memset(anon, 0x77, 4 * MIB); /* the next generation dumps the pattern again */
    snprintf(out, len, "dn=%ld dnl=%ld", dn, dnl);
}

static void check_mremap(char *out, size_t len) {
    uint8_t *p = mremap(grow, 8 * MIB, 4 * MIB, 0);
    if (p == MAP_FAILED) {
        snprintf(out, len, "error=shrink-%d", errno);
        return;
    }
    p = mremap(grow, 4 * MIB, 8 * MIB, MREMAP_MAYMOVE);
    if (p == MAP_FAILED) {
        snprintf(out, len, "error=grow-%d", errno);
        return;
    }
    grow = p;
    long tail = nonzero(grow + 4 * MIB, 4 * MIB);
    int head = all(grow, 4 * MIB, 0x5A);
    memset(grow, 0x5A, 8 * MIB);
    snprintf(out, len, "tail=%ld head=%d", tail, head);
}

static void check_free(char *out, size_t len) {
    int r = madvise(freed, MIB, MADV_FREE);
    int e = r ? errno : 0;
    int valid = 1; /* each page: its bytes or zeros */
    for (size_t off = 0; off < MIB; off += PAGE)
        if (!all(freed + off, PAGE, 0x33) && nonzero(freed + off, PAGE))
            valid = 0;
    memset(freed, 0x33, MIB);
    snprintf(out, len, "free=%d errno=%d valid=%d", r, e, valid);
}

static void check_wipe(char *out, size_t len) {
    int r = madvise(wipe, MIB, MADV_WIPEONFORK);
    int e = r ? errno : 0;
    pid_t pid = fork();
    if (pid == 0)
        _exit(nonzero(wipe, MIB) ? 1 : 0);
    int status = -1;
    waitpid(pid, &status, 0);
    int keep = all(wipe, MIB, 0x55);
    madvise(wipe, MIB, MADV_KEEPONFORK); /* so the next generation converts it again */
    snprintf(out, len, "wipe=%d errno=%d child=%d keep=%d", r, e,
             WIFEXITED(status) ? WEXITSTATUS(status) : 100 + status, keep);
}

static void check_fmap(char *out, size_t len) {
    uint8_t want[FILE_LEN];
    int fd = open(data_file, O_RDONLY | O_CLOEXEC);
    ssize_t n = fd >= 0 ? pread(fd, want, FILE_LEN, 0) : -1;
    if (fd >= 0)
        close(fd);
    int before = all(fmap, WRITTEN, 0xEE);
    madvise(fmap, FILE_LEN, MADV_DONTNEED);
    int same = n == (ssize_t)FILE_LEN && !memcmp(fmap, want, FILE_LEN);
    memset(fmap, 0xEE, WRITTEN);
    snprintf(out, len, "file=%d before=%d", same, before);
}

static void check_own(char *out, size_t len) {
    long before = own_traps;
    long ret = syscall(SYS_getppid);
    kill(getpid(), SIGSYS);
    snprintf(out, len, "got=%ld ret=%ld", own_traps - before, ret);
}

static void check_resig(char *out, size_t len) {
    struct sigaction sa = {0}, old = {0};
    sa.sa_sigaction = on_sigsys;
    sa.sa_flags = SA_SIGINFO;
    int r = sigaction(SIGSYS, &sa, &old);
    snprintf(out, len, "r=%d old=%d", r, old.sa_sigaction == on_sigsys);
}

static int run_child_checks(void) {
    /* what an exec'd program does: none of it may be trapped */
    char out[256];
    anon = map_anon(4 * MIB, 0x77);
    grow = map_anon(8 * MIB, 0x5A);
    check_dontneed(out, sizeof out);
    if (strcmp(out, "dn=0 dnl=0"))
        return 10;
    check_mremap(out, sizeof out);
    if (strcmp(out, "tail=0 head=1"))
        return 11;
    struct sigaction sa = {0};
    sa.sa_handler = SIG_IGN;
    if (sigaction(SIGSYS, &sa, NULL))
        return 12;
    return 0;
}

static void check_exec(char *out, size_t len) {
    pid_t pid = fork();
    if (pid == 0) {
        execl(self_exe, self_exe, "child", (char *)NULL);
        _exit(127);
    }
    int status = -1;
    waitpid(pid, &status, 0);
    snprintf(out, len, "status=%d", WIFEXITED(status) ? WEXITSTATUS(status) : 100 + WTERMSIG(status));
}

static void check_forkchild(char *out, size_t len) {
    pid_t pid = fork();
    if (pid == 0) {
        char o[128];
        check_dontneed(o, sizeof o);
        if (strcmp(o, "dn=0 dnl=0"))
            _exit(10);
        check_mremap(o, sizeof o);
        _exit(strcmp(o, "tail=0 head=1") ? 11 : 0);
    }
    int status = -1;
    waitpid(pid, &status, 0);
    snprintf(out, len, "status=%d", WIFEXITED(status) ? WEXITSTATUS(status) : 100 + WTERMSIG(status));
}

extern char **environ;

static void check_spawn(char *out, size_t len) {
    pid_t pid;
    posix_spawnattr_t attr;
    sigset_t all;
    sigfillset(&all);
    posix_spawnattr_init(&attr);
    posix_spawnattr_setsigdefault(&attr, &all);
    posix_spawnattr_setflags(&attr, POSIX_SPAWN_SETSIGDEF);
    char *argv[] = {(char *)self_exe, "child", NULL};
    int r = posix_spawn(&pid, self_exe, NULL, &attr, argv, environ);
    posix_spawnattr_destroy(&attr);
    int status = -1;
    if (!r)
        waitpid(pid, &status, 0);
    snprintf(out, len, "r=%d status=%d", r, WIFEXITED(status) ? WEXITSTATUS(status) : 100 + WTERMSIG(status));
}

static char thread_out[256];

static void *blocked_thread(void *arg) {
    (void)arg;
    sigset_t all;
    sigfillset(&all);
    pthread_sigmask(SIG_BLOCK, &all, NULL);
    check_dontneed(thread_out, sizeof thread_out);
    return NULL;
}

static void check_blocked(char *out, size_t len) {
    pthread_t t;
    thread_out[0] = 0;
    pthread_create(&t, NULL, blocked_thread, NULL);
    pthread_join(t, NULL);
    snprintf(out, len, "%s", thread_out);
}

static void check_locked(char *out, size_t len) {
    uint8_t *p = anon + 9 * PAGE;
    memset(p, 0x77, PAGE);
    mlock(p, PAGE);
    int r = madvise(p, PAGE, MADV_DONTNEED);
    int e = r ? errno : 0;
    int kept = all(p, PAGE, 0x77);
    munlock(p, PAGE);
    snprintf(out, len, "r=%d errno=%d kept=%d", r, e, kept);
}

static void check_mask(char *out, size_t len) {
    sigset_t set, cur;
    sigemptyset(&set);
    sigaddset(&set, SIGUSR2);
    sigaddset(&set, SIGTTOU);
    sigprocmask(SIG_BLOCK, &set, NULL);
    sigprocmask(SIG_BLOCK, NULL, &cur);
    int kept = sigismember(&cur, SIGUSR2) && sigismember(&cur, SIGTTOU);
    sigprocmask(SIG_UNBLOCK, &set, NULL);
    sigprocmask(SIG_BLOCK, NULL, &cur);
    int gone = !sigismember(&cur, SIGUSR2) && !sigismember(&cur, SIGTTOU);
    snprintf(out, len, "kept=%d gone=%d", kept, gone);
}

static void handle(const char *cmd, char *out, size_t len) {
    static const struct {
        const char *name;
        void (*fn)(char *, size_t);
    } cmds[] = {
        {"dontneed", check_dontneed}, {"mremap", check_mremap}, {"free", check_free},
        {"wipe", check_wipe}, {"fmap", check_fmap}, {"own", check_own},
        {"resig", check_resig}, {"exec", check_exec}, {"forkchild", check_forkchild},
        {"spawn", check_spawn}, {"blocked", check_blocked}, {"mask", check_mask},
        {"locked", check_locked},
    };
    for (size_t i = 0; i < sizeof cmds / sizeof cmds[0]; i++)
        if (!strncmp(cmd, cmds[i].name, strlen(cmds[i].name))) {
            cmds[i].fn(out, len);
            return;
        }
    snprintf(out, len, "error=unknown");
}

static void ctl_path(char *path, size_t len, const char *suffix) {
    char self[64];
    ssize_t n = readlink("/proc/self", self, sizeof self - 1);
    self[n > 0 ? n : 0] = 0;
    snprintf(path, len, "%s/%s%s", ctl_dir, self, suffix);
}

static void serve_once(void) {
    char path[4096], tmp[4096], cmd[256] = "", out[512] = "";
    ctl_path(path, sizeof path, ".cmd");
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return;
    ssize_t n = read(fd, cmd, sizeof cmd - 1);
    close(fd);
    unlink(path);
    if (n <= 0)
        return;
    cmd[n] = 0;
    handle(cmd, out, sizeof out);
    ctl_path(tmp, sizeof tmp, ".out.tmp");
    ctl_path(path, sizeof path, ".out");
    fd = open(tmp, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (fd < 0)
        return;
    if (write(fd, out, strlen(out)) < 0) {
        /* the host times out */
    }
    close(fd);
    rename(tmp, path);
}

int main(int argc, char **argv) {
    static char exe[4096];
    ssize_t n = readlink("/proc/self/exe", exe, sizeof exe - 1);
    exe[n > 0 ? n : 0] = 0;
    self_exe = exe;
    if (argc == 2 && !strcmp(argv[1], "child"))
        return run_child_checks();
    if (argc < 3) {
        fprintf(stderr, "usage: semprog CTL_DIR DATA_FILE [own] | semprog child\n");
        return 2;
    }
    setsid();
    ctl_dir = argv[1];
    data_file = argv[2];
    if (argc > 3 && !strcmp(argv[3], "own")) {
        install_sigsys();
        install_own_filter();
    }
    if (argc > 3 && !strcmp(argv[3], "noquery"))
        install_noquery_filter();
    const char *code = getenv("SEMPROG_EXEC_MAP");
    if (code) {
        int cfd = open(code, O_RDONLY | O_CLOEXEC);
        off_t clen = cfd >= 0 ? lseek(cfd, 0, SEEK_END) : -1;
        if (clen <= 0 || mmap(NULL, (size_t)clen, PROT_READ | PROT_EXEC, MAP_PRIVATE, cfd, 0) == MAP_FAILED) {
            perror(code);
            return 2;
        }
        close(cfd);
    }
    struct sigaction sa = {0};
    sa.sa_handler = on_usr1;
    sigaction(SIGUSR1, &sa, NULL);
    anon = map_anon(4 * MIB, 0x77);
    grow = map_anon(8 * MIB, 0x5A);
    wipe = map_anon(MIB, 0x55);
    freed = map_anon(MIB, 0x33);
    int fd = open(data_file, O_RDONLY | O_CLOEXEC);
    fmap = fd >= 0 ? mmap(NULL, FILE_LEN, PROT_READ | PROT_WRITE, MAP_PRIVATE, fd, 0) : MAP_FAILED;
    if (fmap == MAP_FAILED) {
        perror(data_file);
        return 2;
    }
    close(fd);
    memset(fmap, 0xEE, WRITTEN);

    char path[4096];
    ctl_path(path, sizeof path, ".ready");
    fd = open(path, O_WRONLY | O_CREAT | O_CLOEXEC, 0644);
    if (fd >= 0)
        close(fd);
    sigset_t block, old;
    sigemptyset(&block);
    sigaddset(&block, SIGUSR1);
    sigprocmask(SIG_BLOCK, &block, &old);
    sigdelset(&old, SIGUSR1);
    for (;;) {
        while (!pending)
            sigsuspend(&old);
        pending = 0;
        serve_once();
    }
}
