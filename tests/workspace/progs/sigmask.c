/*
 * A program whose threads block signals, for the fork's trap (issue 30).
 *
 *   sigmask DIR
 *
 * Before answering it: fills 24 MiB with a pattern; blocks every signal but
 * SIGTERM in the main thread and leaves SIGUSR1 pending; starts a worker thread
 * that blocks every signal; starts a POSIX SIGEV_THREAD timer firing every 5 ms
 * (glibc's helper thread blocks every signal too). Then answers requests: DIR/req
 * holds one word, the answer goes to DIR/out (written whole, then renamed).
 *
 *   masks     main thread's mask (sigprocmask), sigpending, SIGUSR2's action's mask
 *             (given as SIGSYS and SIGHUP at the start), each thread's SigBlk
 *             and SigPnd/ShdPnd from /proc/self/task/TID/status, the worker's
 *             mask (pthread_sigmask)
 *   ticks     how many times the timer ran
 *   setaction SIGURG's action set with the mask SIGSYS and SIGUSR1, then read back
 *   dontneed  the worker: MADV_DONTNEED on the pattern, "zero" if it reads zeros,
 *             then mremap shrink and regrow reads zeros too ("zero"), pattern refilled
 *   held      the main thread blocks SIGSYS (its action counts), raises it: whether
 *             it ran, whether sigpending shows it; unblocked: how often it ran
 *   forkmask  the main thread blocks every signal and forks: the child's mask
 *             (sigprocmask) and its SigBlk after exec (grep); the mask restored
 *   churn     1,000 threads started and joined (glibc blocks every signal in a thread
 *             that exits), then the main thread blocks every signal: its mask read back
 *   errors    errno of rt_sigprocmask given a bad how, a bad set, a bad old set (the
 *             mask must not change), and of rt_sigpending given a bad set
 *   timer     a SIGEV_THREAD timer started now whose function (in glibc's thread)
 *             drops a page written at the start (MADV_DONTNEED) and reads it:
 *             "timer ok N bad M" after 20 runs
 *
 * With LATE set in its environment it blocks nothing and starts no timer before
 * the requests; its worker blocks every signal only at its first "dontneed".
 */
#define _GNU_SOURCE
#include <dirent.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <errno.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#define SIZE (24UL << 20)
static char *mem;
static atomic_long ticks;
static const char *dir;
static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t cond = PTHREAD_COND_INITIALIZER;
static int job;          /* 1: dontneed asked of the worker */
static char result[256]; /* the worker's answer */
static sigset_t worker_mask;

static void fill(void) {
    for (size_t i = 0; i < SIZE; i += 64)
        mem[i] = (char)(1 + i / 4096 % 200);
}

static int zeros(const char *p, size_t n) {
    for (size_t i = 0; i < n; i += 64)
        if (p[i])
            return 0;
    return 1;
}

static void on_signal(int sig) {
    (void)sig;
}

static unsigned long long bits(const sigset_t *s);

/* set ``sig``'s action with a mask of ``a`` and ``b``; the mask read back afterwards */
static unsigned long long set_action(int sig, int a, int b) {
    struct sigaction sa = {.sa_handler = on_signal}, got;
    sigemptyset(&sa.sa_mask);
    sigaddset(&sa.sa_mask, a);
    sigaddset(&sa.sa_mask, b);
    sigaction(sig, &sa, NULL);
    sigaction(sig, NULL, &got);
    return bits(&got.sa_mask);
}

static unsigned long long action_mask(int sig) {
    struct sigaction got;
    sigaction(sig, NULL, &got);
    return bits(&got.sa_mask);
}

static char *page;          /* written at the start: a timer's function drops it */
static atomic_long page_ok, page_bad;
static volatile sig_atomic_t sys_ran;

static void tick(union sigval v) {
    (void)v;
    ticks++;
}

static void drop_page(union sigval v) {
    static pthread_mutex_t one = PTHREAD_MUTEX_INITIALIZER; /* runs may overlap (a thread each) */
    (void)v;
    pthread_mutex_lock(&one);
    if (madvise(page, 4096, MADV_DONTNEED) == 0 && zeros(page, 4096))
        page_ok++;
    else
        page_bad++;
    memset(page, 7, 4096);
    pthread_mutex_unlock(&one);
}

static void on_sys(int sig) {
    (void)sig;
    sys_ran++;
}

static void dontneed(char *out) {
    int ok = madvise(mem, SIZE / 2, MADV_DONTNEED) == 0 && zeros(mem, SIZE / 2);
    char *p = mremap(mem + SIZE / 2, SIZE / 2, 4096, 0);
    p = p == MAP_FAILED ? p : mremap(p, 4096, SIZE / 2, 0);
    int ok2 = p == mem + SIZE / 2 && zeros(p + 4096, SIZE / 2 - 4096);
    sprintf(out, "%s %s", ok ? "zero" : "stale", ok2 ? "zero" : "stale");
    fill();
}

static void *worker(void *arg) {
    (void)arg;
    sigset_t all;
    sigfillset(&all);
    if (!getenv("LATE"))
        pthread_sigmask(SIG_SETMASK, &all, NULL);
    pthread_mutex_lock(&lock);
    for (;;) {
        while (!job)
            pthread_cond_wait(&cond, &lock);
        pthread_sigmask(SIG_BLOCK, &all, NULL);
        pthread_sigmask(SIG_SETMASK, NULL, &worker_mask);
        dontneed(result);
        job = 0;
        pthread_cond_broadcast(&cond);
    }
    return NULL;
}

static unsigned long long bits(const sigset_t *s) {
    unsigned long long v = 0;
    for (int sig = 1; sig <= 64; sig++)
        if (sigismember(s, sig) == 1)
            v |= 1ULL << (sig - 1);
    return v;
}

static int tids(int *out, int max) {
    int n = 0;
    DIR *d = opendir("/proc/self/task");
    struct dirent *e;
    while (d && (e = readdir(d)) && n < max)
        if (e->d_name[0] != '.')
            out[n++] = atoi(e->d_name);
    if (d)
        closedir(d);
    return n;
}

/* threads present 10 ms apart (not the timer's short-lived notification threads), in tid order */
static void status_lines(FILE *out) {
    int a[64], b[64], na = tids(a, 64), nb;
    char path[128], line[256];
    usleep(10000);
    nb = tids(b, 64);
    for (int i = 0; i < na; i++) {
        int both = 0;
        for (int j = 0; j < nb; j++)
            both |= a[i] == b[j];
        snprintf(path, sizeof path, "/proc/self/task/%d/status", a[i]);
        FILE *f = both ? fopen(path, "r") : NULL;
        if (!f)
            continue;
        while (fgets(line, sizeof line, f))
            if (!strncmp(line, "SigBlk:", 7) || !strncmp(line, "SigPnd:", 7) || !strncmp(line, "ShdPnd:", 7))
                fprintf(out, " %.*s", (int)strcspn(line, "\n"), line);
        fclose(f);
    }
}

static void held(FILE *f) {
    struct sigaction sa = {.sa_handler = on_sys};
    sigset_t s, old, pend;
    sigemptyset(&sa.sa_mask);
    sigaction(SIGSYS, &sa, NULL);
    sigemptyset(&s);
    sigaddset(&s, SIGSYS);
    sys_ran = 0;
    sigprocmask(SIG_BLOCK, &s, &old);
    raise(SIGSYS);
    int ran = sys_ran;
    sigpending(&pend);
    sigprocmask(SIG_SETMASK, &old, NULL);
    fprintf(f, "held ran %d pending %d after %d", ran, sigismember(&pend, SIGSYS), (int)sys_ran);
}

static void forkmask(FILE *f) {
    sigset_t all, old;
    int fds[2];
    char buf[256] = "";
    sigfillset(&all);
    sigprocmask(SIG_SETMASK, &all, &old);
    if (pipe(fds))
        return;
    pid_t c = fork();
    if (c == 0) {
        sigset_t cur;
        sigprocmask(SIG_BLOCK, NULL, &cur);
        dprintf(fds[1], "child %llx ", bits(&cur));
        dup2(fds[1], 1);
        execl("/bin/grep", "grep", "SigBlk", "/proc/self/status", (char *)NULL);
        _exit(127);
    }
    close(fds[1]);
    size_t n = 0;
    ssize_t r;
    while (n < sizeof buf - 1 && (r = read(fds[0], buf + n, sizeof buf - 1 - n)) > 0)
        n += (size_t)r;
    buf[n] = 0;
    close(fds[0]);
    int status = -1;
    waitpid(c, &status, 0);
    sigprocmask(SIG_SETMASK, &old, NULL);
    fprintf(f, "%.*s status %d", (int)strcspn(buf, "\n"), buf, status);
}

static void errors(FILE *f) {
    sigset_t s, before, after;
    sigemptyset(&s);
    sigaddset(&s, SIGSYS);
    sigprocmask(SIG_BLOCK, NULL, &before);
    long a = syscall(SYS_rt_sigprocmask, 99, &s, NULL, 8) ? errno : 0;
    long b = syscall(SYS_rt_sigprocmask, SIG_BLOCK, (void *)8, NULL, 8) ? errno : 0;
    long c = syscall(SYS_rt_sigprocmask, SIG_BLOCK, &s, (void *)8, 8) ? errno : 0; /* blocks, then EFAULT */
    sigprocmask(SIG_BLOCK, NULL, &after);
    sigprocmask(SIG_SETMASK, &before, NULL);
    long d = syscall(SYS_rt_sigpending, (void *)8, 8) ? errno : 0;
    fprintf(f, "errors %ld %ld %ld %ld blocked %llx", a, b, c, d, bits(&after) & ~bits(&before));
}

static void *nothing(void *arg) {
    return arg;
}

static void churn(FILE *f) {
    sigset_t all, got, old;
    for (int i = 0; i < 1000; i++) {
        pthread_t t;
        if (pthread_create(&t, NULL, nothing, NULL)) {
            fprintf(f, "churn failed at %d", i);
            return;
        }
        pthread_join(t, NULL);
    }
    sigfillset(&all);
    pthread_sigmask(SIG_BLOCK, &all, &old);
    pthread_sigmask(SIG_SETMASK, NULL, &got);
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    fprintf(f, "churn %llx", bits(&got));
}

static void timer(FILE *f) {
    struct sigevent ev = {.sigev_notify = SIGEV_THREAD, .sigev_notify_function = drop_page};
    struct itimerspec every = {{0, 2000000}, {0, 2000000}}, stop = {{0, 0}, {0, 0}};
    timer_t t;
    page_ok = page_bad = 0;
    if (timer_create(CLOCK_MONOTONIC, &ev, &t) || timer_settime(t, 0, &every, NULL)) {
        fprintf(f, "timer failed");
        return;
    }
    while (page_ok + page_bad < 20)
        usleep(1000);
    timer_settime(t, 0, &stop, NULL);
    timer_delete(t);
    fprintf(f, "timer ok %d bad %d", page_ok >= 20, (int)page_bad);
}

static void answer(const char *req) {
    char tmp[512], fin[512];
    FILE *f;
    snprintf(tmp, sizeof tmp, "%s/out.tmp", dir);
    snprintf(fin, sizeof fin, "%s/out", dir);
    f = fopen(tmp, "w");
    if (!strcmp(req, "ticks")) {
        fprintf(f, "%ld", (long)ticks);
    } else if (!strcmp(req, "dontneed")) {
        pthread_mutex_lock(&lock);
        job = 1;
        pthread_cond_broadcast(&cond);
        while (job)
            pthread_cond_wait(&cond, &lock);
        fprintf(f, "%s worker %llx", result, bits(&worker_mask));
        pthread_mutex_unlock(&lock);
    } else if (!strcmp(req, "held")) {
        held(f);
    } else if (!strcmp(req, "forkmask")) {
        forkmask(f);
    } else if (!strcmp(req, "churn")) {
        churn(f);
    } else if (!strcmp(req, "errors")) {
        errors(f);
    } else if (!strcmp(req, "timer")) {
        timer(f);
    } else if (!strcmp(req, "setaction")) {
        fprintf(f, "urg %llx", set_action(SIGURG, SIGSYS, SIGUSR1));
    } else if (!strcmp(req, "masks")) {
        sigset_t cur, pend;
        sigprocmask(SIG_BLOCK, NULL, &cur);
        sigpending(&pend);
        fprintf(f, "mask %llx pending %llx usr2 %llx", bits(&cur), bits(&pend), action_mask(SIGUSR2));
        status_lines(f);
    } else {
        fprintf(f, "unknown %s", req);
    }
    fclose(f);
    rename(tmp, fin);
}

int main(int argc, char **argv) {
    char path[512], req[64];
    if (argc != 2)
        return 2;
    dir = argv[1];
    mem = mmap(NULL, SIZE, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    fill();
    page = mmap(NULL, 4096, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    memset(page, 7, 4096);
    int late = getenv("LATE") != NULL;
    set_action(SIGUSR2, SIGSYS, SIGHUP);
    sigset_t mask;
    sigfillset(&mask);
    sigdelset(&mask, SIGTERM);
    if (!late) {
        sigprocmask(SIG_SETMASK, &mask, NULL);
        raise(SIGUSR1); /* stays pending */
    }
    pthread_t th;
    pthread_create(&th, NULL, worker, NULL);
    struct sigevent ev = {.sigev_notify = SIGEV_THREAD, .sigev_notify_function = tick};
    timer_t timer;
    struct itimerspec every = {{0, 5000000}, {0, 5000000}};
    if (late)
        ticks = 3;
    else if (timer_create(CLOCK_MONOTONIC, &ev, &timer) || timer_settime(timer, 0, &every, NULL))
        return 3;
    while (ticks < 3)
        usleep(1000);
    snprintf(path, sizeof path, "%s/ready", dir);
    FILE *f = fopen(path, "w");
    fprintf(f, "%d\n", getpid());
    fclose(f);
    snprintf(path, sizeof path, "%s/req", dir);
    for (;;) {
        f = fopen(path, "r");
        if (!f) {
            usleep(2000);
            continue;
        }
        req[0] = 0;
        if (fscanf(f, "%63s", req) != 1)
            req[0] = 0;
        fclose(f);
        unlink(path);
        answer(req);
    }
}
