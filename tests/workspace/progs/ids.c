/* A service that reports who it runs as, as a forked workspace's programs must keep:
 *
 *   ids DIR            run as started (e.g. under setpriv, or as an image's User)
 *   ids DIR UID        start as root, then become UID (setresgid/setresuid, no
 *                      supplementary groups) once DIR/go exists, as ZDTM's
 *                      mlock_setuid does
 *
 * It locks 1 MiB of memory holding a pattern (mlock) first. Every 50 ms it writes
 * DIR/state anew (a new file each time, so it is owned by whoever the process is
 * now): "ruid euid suid rgid egid sgid ngroups vmlck_kib pattern_ok counter".
 * DIR/ready holds its pid once it is locked and (if asked) before it changes uid.
 */
#define _GNU_SOURCE
#include <grp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#define LOCKED (1 << 20)

static long vmlck_kib(void)
{
	char line[256];
	long kib = -1;
	FILE *f = fopen("/proc/self/status", "r");
	if (!f)
		return -1;
	while (fgets(line, sizeof(line), f))
		if (sscanf(line, "VmLck: %ld kB", &kib) == 1)
			break;
	fclose(f);
	return kib;
}

static void put(const char *dir, const char *name, const char *text)
{
	char tmp[4096], path[4096];
	snprintf(tmp, sizeof(tmp), "%s/.%s.tmp", dir, name);
	snprintf(path, sizeof(path), "%s/%s", dir, name);
	unlink(tmp);
	FILE *f = fopen(tmp, "w");
	if (!f || fputs(text, f) < 0 || fclose(f) != 0 || rename(tmp, path) != 0) {
		perror(path);
		exit(1);
	}
}

int main(int argc, char **argv)
{
	if (argc < 2) {
		fprintf(stderr, "usage: ids DIR [UID]\n");
		return 2;
	}
	const char *dir = argv[1];
	unsigned char *mem = mmap(NULL, LOCKED, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
	if (mem == MAP_FAILED)
		return 1;
	for (size_t i = 0; i < LOCKED; i++)
		mem[i] = (unsigned char)(i * 7 + 3);
	if (mlock(mem, LOCKED)) {
		perror("mlock");
		return 1;
	}
	char text[256];
	snprintf(text, sizeof(text), "%d\n", getpid());
	put(dir, "ready", text);
	if (argc > 2) {
		uid_t uid = (uid_t)atoi(argv[2]);
		char go[4096];
		snprintf(go, sizeof(go), "%s/go", dir);
		while (access(go, F_OK) != 0)
			usleep(10000);
		if (setgroups(0, NULL) || setresgid(uid, uid, uid) || setresuid(uid, uid, uid)) {
			perror("setuid");
			return 1;
		}
	}
	for (unsigned long counter = 0;; counter++) {
		uid_t r, e, s;
		gid_t rg, eg, sg;
		getresuid(&r, &e, &s);
		getresgid(&rg, &eg, &sg);
		int ok = 1;
		for (size_t i = 0; i < LOCKED; i++)
			if (mem[i] != (unsigned char)(i * 7 + 3)) {
				ok = 0;
				break;
			}
		snprintf(text, sizeof(text), "%u %u %u %u %u %u %d %ld %d %lu\n", r, e, s, rg, eg, sg,
			 getgroups(0, NULL), vmlck_kib(), ok, counter);
		put(dir, "state", text);
		usleep(50000);
	}
}
