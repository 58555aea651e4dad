/*
 * arenas THREADS: glibc arenas that shrink and regrow, forever.
 *
 * Every thread (and the main thread, in the main arena) loops: malloc blocks of
 * 1..192 KiB and fill them with 0xA5, free them (the arena's top shrinks past a
 * small trim threshold: glibc gives the pages back with MADV_DONTNEED or brk),
 * calloc blocks and check that every byte is zero, free them, and every few
 * rounds malloc_trim(0). Any non-zero byte calloc returns is counted as stale.
 * Every 100 ms the main thread writes "ROUNDS STALE" to /tmp/arenas.status.
 */
#define _GNU_SOURCE
#include <malloc.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#define NB 96
#define MAXT 16

static volatile long rounds, stale;
static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;

static size_t pick(unsigned *seed) { return 1024 + (size_t)(rand_r(seed) % (192 * 1024)); }

static void cycle(unsigned *seed) {
    void *p[NB];
    size_t n[NB];
    long bad = 0;
    for (int i = 0; i < NB; i++) {
        n[i] = pick(seed);
        p[i] = malloc(n[i]);
        memset(p[i], 0xA5, n[i]);
    }
    for (int i = NB - 1; i >= 0; i--)
        free(p[i]);
    for (int i = 0; i < NB; i++) {
        n[i] = pick(seed);
        unsigned char *c = calloc(1, n[i]);
        for (size_t j = 0; j < n[i]; j++)
            bad += c[j] != 0;
        memset(c, 0xA5, n[i]);
        p[i] = c;
    }
    for (int i = 0; i < NB; i++)
        free(p[i]);
    pthread_mutex_lock(&mu);
    rounds++;
    stale += bad;
    if (rounds % 8 == 0)
        malloc_trim(0);
    pthread_mutex_unlock(&mu);
}

static void *worker(void *arg) {
    unsigned seed = (unsigned)(long)arg;
    for (;;)
        cycle(&seed);
    return NULL;
}

int main(int argc, char **argv) {
    int threads = argc > 1 ? atoi(argv[1]) : 4;
    if (threads > MAXT)
        threads = MAXT;
    mallopt(M_MMAP_THRESHOLD, 256 * 1024);  /* fixed: every block stays in an arena */
    mallopt(M_TRIM_THRESHOLD, 64 * 1024);
    pthread_t t[MAXT];
    for (int i = 0; i < threads; i++)
        pthread_create(&t[i], NULL, worker, (void *)(long)(i + 1));
    unsigned seed = 99;
    struct timespec last = {0}, now;
    for (;;) {
        cycle(&seed);
        clock_gettime(CLOCK_MONOTONIC, &now);
        if ((now.tv_sec - last.tv_sec) * 1000 + (now.tv_nsec - last.tv_nsec) / 1000000 >= 100) {
            last = now;
            pthread_mutex_lock(&mu);
            FILE *f = fopen("/tmp/arenas.status.tmp", "w");
            if (f) {
                fprintf(f, "%ld %ld\n", rounds, stale);
                fclose(f);
                rename("/tmp/arenas.status.tmp", "/tmp/arenas.status");
            }
            pthread_mutex_unlock(&mu);
        }
    }
}
