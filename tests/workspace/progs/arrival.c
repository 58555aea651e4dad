/*
 * arrival HOW DIR: waits for its restore into another pid namespace (a clone), then
 * dies there at once: HOW "segv" raises SIGSEGV (no core), "exit" exits with 0, "stop"
 * stops itself (SIGSTOP), "hang" hangs in uninterruptible sleep (a vfork whose child
 * waits for ever: the parent waits for it in D).
 * Writes DIR/ready (its pid) when it runs.
 */
#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <sys/resource.h>
#include <time.h>
#include <unistd.h>

int main(int argc, char **argv) {
    char first[64] = {0}, now[64], path[512];
    struct rlimit none = {0, 0};
    if (argc != 3 || readlink("/proc/self/ns/pid", first, sizeof first - 1) < 0)
        return 2;
    setrlimit(RLIMIT_CORE, &none);
    snprintf(path, sizeof path, "%s/ready", argv[2]);
    FILE *f = fopen(path, "w");
    fprintf(f, "%d\n", getpid());
    fclose(f);
    struct timespec nap = {0, 200000};
    for (;;) {
        nanosleep(&nap, NULL);
        memset(now, 0, sizeof now);
        if (readlink("/proc/self/ns/pid", now, sizeof now - 1) > 0 && strcmp(now, first)) {
            if (!strcmp(argv[1], "exit"))
                return 0;
            if (!strcmp(argv[1], "hang") && vfork() == 0)
                for (;;)
                    pause();
            raise(strcmp(argv[1], "stop") ? SIGSEGV : SIGSTOP);
            memcpy(first, now, sizeof first); /* stopped, then continued: waits for the next clone */
        }
    }
}
