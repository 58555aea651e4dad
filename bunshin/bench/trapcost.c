/*
 * trapcost: what one call costs that the SIGSYS trap of converted memory intercepts.
 *
 *   trapcost MIB
 *
 * Holds MIB MiB of written anonymous memory (converted by a fork), writes
 * /tmp/trapcost.ready, then on each request (/tmp/trapcost.req appears) times, in
 * nanoseconds per call: madvise(MADV_DONTNEED) of one page of that memory the
 * first time (in a clone: trapped, the page becomes anonymous), of the same page
 * again (trapped, nothing left to do), of a page of fresh anonymous memory (not
 * trapped: the filter's test only), rt_sigprocmask(SIG_BLOCK) and one that only
 * reads the mask (both trapped: each thread's SIGSYS block lives in the handler's
 * state) and getpid (a baseline). The answer, one JSON object, goes to
 * /tmp/trapcost.out.
 */
#define _GNU_SOURCE
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#define PAGE 4096UL
#define CALLS 256

static double now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1e9 + t.tv_nsec;
}

static unsigned char *mem, *fresh;
static size_t len;
static size_t next_page;

static double per_call_dontneed(unsigned char *base, size_t first, int same) {
    double t0 = now_ns();
    for (size_t i = 0; i < CALLS; i++)
        madvise(base + (first + (same ? 0 : i)) * 2 * PAGE, PAGE, MADV_DONTNEED);
    return (now_ns() - t0) / CALLS;
}

static void measure(FILE *out) {
    size_t first = next_page;
    next_page += CALLS;
    if ((next_page + 1) * 2 * PAGE > len) {
        fprintf(out, "{\"error\": \"out of pages\"}\n");
        return;
    }
    double converted = per_call_dontneed(mem, first, 0);
    /* the same pages again: each is anonymous by now */
    double t0 = now_ns();
    for (size_t i = 0; i < CALLS; i++)
        madvise(mem + (first + i) * 2 * PAGE, PAGE, MADV_DONTNEED);
    double again = (now_ns() - t0) / CALLS;
    memset(fresh, 1, CALLS * 2 * PAGE);
    double anon = per_call_dontneed(fresh, 0, 0);
    sigset_t set, old;
    sigemptyset(&set);
    sigaddset(&set, SIGUSR2);
    t0 = now_ns();
    for (int i = 0; i < CALLS; i++) {
        sigprocmask(SIG_BLOCK, &set, &old);
        sigprocmask(SIG_SETMASK, &old, NULL);
    }
    double mask = (now_ns() - t0) / (2 * CALLS);
    t0 = now_ns();
    for (int i = 0; i < CALLS; i++)
        sigprocmask(SIG_BLOCK, NULL, &old);
    double mask_read = (now_ns() - t0) / CALLS;
    t0 = now_ns();
    for (int i = 0; i < CALLS; i++)
        syscall(SYS_getpid);
    double getpid_ns = (now_ns() - t0) / CALLS;
    fprintf(out,
            "{\"calls\": %d, \"dontneed_converted_ns\": %.0f, \"dontneed_again_ns\": %.0f, "
            "\"dontneed_fresh_anon_ns\": %.0f, \"sigprocmask_ns\": %.0f, \"sigprocmask_read_ns\": %.0f, "
            "\"getpid_ns\": %.0f}\n",
            CALLS, converted, again, anon, mask, mask_read, getpid_ns);
}

int main(int argc, char **argv) {
    len = (argc > 1 ? strtoul(argv[1], NULL, 10) : 64) << 20;
    mem = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    fresh = mmap(NULL, CALLS * 2 * PAGE, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (mem == MAP_FAILED || fresh == MAP_FAILED)
        return 2;
    memset(mem, 0x5A, len);
    FILE *r = fopen("/tmp/trapcost.ready", "w");
    if (r)
        fclose(r);
    for (;;) {
        if (access("/tmp/trapcost.req", F_OK) == 0) {
            unlink("/tmp/trapcost.req");
            FILE *out = fopen("/tmp/trapcost.out.tmp", "w");
            if (out) {
                measure(out);
                fclose(out);
                rename("/tmp/trapcost.out.tmp", "/tmp/trapcost.out");
            }
        }
        usleep(10000);
    }
}
