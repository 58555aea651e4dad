/* A file watcher, as an IDE or a dev server holds one: one inotify instance with a
 * watch on each path given, each event appended to LOG as "PATH MASK NAME".
 *
 *   watch LOG PATH...
 *
 * Once every watch is in place it writes its pid to LOG.ready. It never ends.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/inotify.h>
#include <unistd.h>

#define MASK (IN_MODIFY | IN_ATTRIB | IN_CREATE | IN_DELETE | IN_CLOSE_WRITE | IN_MOVED_TO)

int main(int argc, char **argv)
{
	if (argc < 3) {
		fprintf(stderr, "usage: watch LOG PATH...\n");
		return 2;
	}
	int fd = inotify_init1(IN_CLOEXEC);
	if (fd < 0) {
		perror("inotify_init1");
		return 1;
	}
	char **paths = calloc(argc, sizeof(char *));
	for (int i = 2; i < argc; i++) {
		int wd = inotify_add_watch(fd, argv[i], MASK);
		if (wd < 0 || wd >= argc) {
			perror(argv[i]);
			return 1;
		}
		paths[wd] = argv[i];
	}
	FILE *log = fopen(argv[1], "a");
	if (!log) {
		perror(argv[1]);
		return 1;
	}
	char ready[4096];
	snprintf(ready, sizeof(ready), "%s.ready", argv[1]);
	FILE *r = fopen(ready, "w");
	if (!r) {
		perror(ready);
		return 1;
	}
	fprintf(r, "%d\n", getpid());
	fclose(r);
	char buf[8192] __attribute__((aligned(__alignof__(struct inotify_event))));
	for (;;) {
		ssize_t n = read(fd, buf, sizeof(buf));
		if (n <= 0) {
			perror("read");
			return 1;
		}
		for (char *p = buf; p < buf + n;) {
			struct inotify_event *e = (struct inotify_event *)p;
			const char *path = e->wd > 0 && e->wd < argc && paths[e->wd] ? paths[e->wd] : "?";
			fprintf(log, "%s %x %s\n", path, e->mask, e->len ? e->name : "-");
			fflush(log);
			p += sizeof(*e) + e->len;
		}
	}
}
