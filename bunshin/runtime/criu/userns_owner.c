/*
 * bunshin: loaded into a restore's criu (ld.so --preload). CRIU makes a restored tree's
 * user namespace with clone3(CLONE_NEWUSER | ...), and the kernel makes its creator's
 * euid the namespace's owner, to which every per-owner count of the tree (inotify, message
 * queues, pending signals, processes) is charged in the host's namespace. criu runs as
 * host root; this clone3 alone runs with the euid and egid named in the file
 * "userns-owner" of criu's working folder (its images folder: bunshin's clone_images),
 * the clone's own range, keeping every capability (SECBIT_NO_SETUID_FIXUP). criu is back
 * to root at once; the new task's credentials are its namespace's (the kernel resets its
 * securebits and capabilities there). Without the file nothing changes.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <fcntl.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdlib.h>
#include <sys/prctl.h>
#include <sys/syscall.h>
#include <unistd.h>

#ifndef SYS_clone3
#define SYS_clone3 435
#endif
#define OWNER_FILE "userns-owner"
#define NEWUSER 0x10000000ULL
#define NO_SETUID_FIXUP (1 << 2)

typedef long (*syscall_fn)(long, ...);
static syscall_fn real_syscall;

static long owner(void)
{
	char buf[24];
	char *end;
	long v;
	ssize_t n;
	int fd = open(OWNER_FILE, O_RDONLY | O_CLOEXEC | O_NOFOLLOW);

	if (fd < 0)
		return -1;
	n = read(fd, buf, sizeof(buf) - 1);
	close(fd);
	if (n <= 0)
		return -1;
	buf[n] = '\0';
	v = strtol(buf, &end, 10);
	return (end == buf || v <= 0 || v >= 0xFFFFFFFFL) ? -1 : v;
}

long syscall(long nr, ...)
{
	va_list ap;
	long a[6], ret, uid, bits = -1, dumpable;
	int i;

	va_start(ap, nr);
	for (i = 0; i < 6; i++)
		a[i] = va_arg(ap, long);
	va_end(ap);
	if (!real_syscall)
		real_syscall = (syscall_fn)dlsym(RTLD_NEXT, "syscall");
	if (nr != SYS_clone3 || !a[0] || !(((uint64_t *)a[0])[0] & NEWUSER) || (uid = owner()) < 0)
		return real_syscall(nr, a[0], a[1], a[2], a[3], a[4], a[5]);
	bits = prctl(PR_GET_SECUREBITS);
	dumpable = prctl(PR_GET_DUMPABLE);
	/* A change of euid makes the process undumpable (its /proc files then root's): the
	 * child, which writes its own /proc files before its ids are mapped, is made dumpable. */
	if (bits < 0 || dumpable < 0 || prctl(PR_SET_SECUREBITS, bits | NO_SETUID_FIXUP) ||
	    real_syscall(SYS_setresgid, -1L, uid, -1L) || real_syscall(SYS_setresuid, -1L, uid, -1L) ||
	    prctl(PR_SET_DUMPABLE, 1))
		_exit(121); /* never make the namespace as root when another owner was asked */
	ret = real_syscall(nr, a[0], a[1], a[2], a[3], a[4], a[5]);
	if (ret != 0) { /* criu itself (the child returns 0: its credentials are its namespace's) */
		if (real_syscall(SYS_setresuid, -1L, 0L, -1L) || real_syscall(SYS_setresgid, -1L, 0L, -1L) ||
		    prctl(PR_SET_SECUREBITS, bits) || prctl(PR_SET_DUMPABLE, dumpable))
			_exit(122);
	}
	return ret;
}
