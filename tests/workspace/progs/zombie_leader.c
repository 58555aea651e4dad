/* A zombie thread-group leader: the main thread exits (pthread_exit) while a
 * second thread keeps running, as in CRIU's ZDTM test pthread02.
 *     zombie_leader READY_FILE [noname]
 * The thread writes READY_FILE once the leader is gone, then sleeps. With "noname" the
 * leader first empties its name (prctl PR_SET_NAME ""): its comm reads empty too. */
#include <pthread.h>
#include <string.h>
#include <sys/prctl.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

static const char *ready;

static void *worker(void *arg) {
    (void)arg;
    char path[64];
    snprintf(path, sizeof(path), "/proc/%d/stat", getpid());
    for (;;) { /* wait until the leader is a zombie */
        FILE *f = fopen(path, "r");
        char state = 0;
        if (f && fscanf(f, "%*d %*s %c", &state) == 1 && state == 'Z') {
            fclose(f);
            break;
        }
        if (f)
            fclose(f);
        usleep(1000);
    }
    FILE *out = fopen(ready, "w");
    if (out) {
        fputs("1\n", out);
        fclose(out);
    }
    for (;;)
        sleep(1);
    return NULL;
}

int main(int argc, char **argv) {
    pthread_t t;
    if (argc != 2 && argc != 3)
        return 2;
    ready = argv[1];
    if (argc == 3 && strcmp(argv[2], "noname") == 0)
        prctl(PR_SET_NAME, "", 0, 0, 0);
    if (pthread_create(&t, NULL, worker, NULL))
        return 1;
    pthread_exit(NULL);
}
