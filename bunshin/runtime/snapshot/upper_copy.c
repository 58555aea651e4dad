/*
 * The frozen copy of a workspace's upper folder: `upper_copy GO DONE SRC DST`.
 *
 * Started before the dump (in the workspace's memory cgroup), it opens the fifos GO
 * and DONE, then waits for one byte on GO: the moment the workspace's tasks are frozen.
 * It then copies the folder SRC to DST (which must not exist) as `cp -a` does: folders,
 * regular files (holes kept), symlinks, device nodes (overlay whiteouts), fifos and
 * sockets, hard links within the tree, owners, modes, extended attributes (overlay's
 * trusted.* included) and times; and writes "0\n" to DONE, or "1\n" after saying what
 * failed on stderr; then it waits for EOF on GO (the caller closes it after the dump)
 * and ends. EOF on GO before the byte (the caller gave up) ends it without copying.
 *
 * SRC is written by a hostile workspace (frozen meanwhile): nothing in it is followed.
 * Every name is opened relative to its folder's descriptor with O_NOFOLLOW, checked
 * to be what was listed, and special files are never opened at all.
 */
#define _GNU_SOURCE
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <sys/types.h>
#include <sys/xattr.h>
#include <unistd.h>

#define XATTR_LIST_MAX_ 65536
#define XATTR_SIZE_MAX_ 65536
#define BUF_SIZE (128 * 1024)

static int dst_root = -1;
static char rel[PATH_MAX];     /* the entry being copied, relative to DST */
static size_t rel_len;

/* Inodes with more than one name, copied once: an open-addressing table by inode. */
struct link_ent {
	dev_t dev;
	ino_t ino;
	char *path; /* relative to DST; NULL: a free slot */
};
static struct link_ent *links;
static size_t n_links, cap_links;

static int fail(const char *fmt, ...)
{
	va_list ap;
	int err = errno;

	va_start(ap, fmt);
	fprintf(stderr, "upper_copy: ");
	vfprintf(stderr, fmt, ap);
	if (err)
		fprintf(stderr, ": %s", strerror(err));
	fprintf(stderr, " (at /%.*s)\n", (int)rel_len, rel);
	va_end(ap);
	return -1;
}

static int push(const char *name, size_t *saved)
{
	size_t n = strlen(name);

	*saved = rel_len;
	if (rel_len + (rel_len ? 1 : 0) + n + 1 > sizeof(rel)) {
		errno = ENAMETOOLONG;
		return fail("path too long");
	}
	if (rel_len)
		rel[rel_len++] = '/';
	memcpy(rel + rel_len, name, n);
	rel_len += n;
	rel[rel_len] = 0;
	return 0;
}

static void pop(size_t saved)
{
	rel_len = saved;
	rel[rel_len] = 0;
}

/* The extended attributes of an entry, by descriptor (fd >= 0) or, for symlinks and
 * special files, by "/proc/self/fd/DIR/NAME" without following NAME. */
static int copy_xattrs(int sfd, int dfd, const char *spath, const char *dpath)
{
	static char names[XATTR_LIST_MAX_], value[XATTR_SIZE_MAX_];
	ssize_t len = sfd >= 0 ? flistxattr(sfd, names, sizeof(names)) : llistxattr(spath, names, sizeof(names));

	if (len < 0) {
		if (errno == ENOTSUP)
			return 0;
		return fail("list extended attributes");
	}
	for (char *name = names; name < names + len; name += strlen(name) + 1) {
		ssize_t vlen = sfd >= 0 ? fgetxattr(sfd, name, value, sizeof(value))
					: lgetxattr(spath, name, value, sizeof(value));
		if (vlen < 0) {
			if (errno == ENODATA)
				continue; /* gone meanwhile */
			return fail("read extended attribute %s", name);
		}
		int r = dfd >= 0 ? fsetxattr(dfd, name, value, vlen, 0) : lsetxattr(dpath, name, value, vlen, 0);
		if (r < 0)
			return fail("set extended attribute %s", name);
	}
	return 0;
}

static int times_of(int dirfd, const char *name, const struct stat *st)
{
	struct timespec ts[2] = { st->st_atim, st->st_mtim };

	if (utimensat(dirfd, name, ts, AT_SYMLINK_NOFOLLOW) < 0)
		return fail("set times");
	return 0;
}

/* Owner, mode, extended attributes of an opened copy (chown first: it clears set-id
 * bits and file capabilities, which the mode and the attributes then bring back). */
static int meta_fd(int sfd, int dfd, const struct stat *st)
{
	if (fchown(dfd, st->st_uid, st->st_gid) < 0)
		return fail("set owner");
	if (fchmod(dfd, st->st_mode & 07777) < 0)
		return fail("set mode");
	return copy_xattrs(sfd, dfd, NULL, NULL);
}

static int meta_path(int sdir, int ddir, const char *name, const struct stat *st)
{
	char spath[64 + NAME_MAX], dpath[64 + NAME_MAX];

	snprintf(spath, sizeof(spath), "/proc/self/fd/%d/%s", sdir, name);
	snprintf(dpath, sizeof(dpath), "/proc/self/fd/%d/%s", ddir, name);
	if (fchownat(ddir, name, st->st_uid, st->st_gid, AT_SYMLINK_NOFOLLOW) < 0)
		return fail("set owner");
	if (!S_ISLNK(st->st_mode) && fchmodat(ddir, name, st->st_mode & 07777, 0) < 0)
		return fail("set mode");
	if (copy_xattrs(-1, -1, spath, dpath) < 0)
		return -1;
	return times_of(ddir, name, st);
}

/* Open NAME in DIR without following it and check it is still the entry listed. */
static int open_same(int dir, const char *name, int flags, const struct stat *st)
{
	struct stat now;
	int fd = openat(dir, name, flags | O_NOFOLLOW | O_CLOEXEC);

	if (fd < 0) {
		fail("open");
		return -1;
	}
	if (fstat(fd, &now) < 0 || now.st_dev != st->st_dev || now.st_ino != st->st_ino ||
	    (now.st_mode & S_IFMT) != (st->st_mode & S_IFMT)) {
		close(fd);
		errno = 0;
		fail("changed while being copied");
		return -1;
	}
	return fd;
}

static int copy_range(int in, int out, off_t off, off_t end)
{
	static char buf[BUF_SIZE];
	static int plain; /* copy_file_range refused once (another file system): read and write */

	while (off < end) {
		size_t want = end - off > (1 << 30) ? (1 << 30) : (size_t)(end - off);
		ssize_t n;

		if (!plain) {
			loff_t i = off, o = off;

			n = copy_file_range(in, &i, out, &o, want, 0);
			if (n < 0 && (errno == EXDEV || errno == EINVAL || errno == ENOSYS || errno == EOPNOTSUPP)) {
				plain = 1;
				continue;
			}
		} else {
			n = pread(in, buf, want < sizeof(buf) ? want : sizeof(buf), off);
			if (n > 0 && pwrite(out, buf, n, off) != n)
				return fail("write");
		}
		if (n < 0)
			return fail("copy data");
		if (n == 0)
			break; /* shorter than it was */
		off += n;
	}
	return 0;
}

static int copy_data(int in, int out, const struct stat *st)
{
	off_t off = 0;

	while (off < st->st_size) {
		off_t data = lseek(in, off, SEEK_DATA), hole;

		if (data < 0) {
			if (errno == ENXIO)
				break; /* only a hole is left */
			return fail("seek data");
		}
		hole = lseek(in, data, SEEK_HOLE);
		if (hole < 0)
			return fail("seek hole");
		if (copy_range(in, out, data, hole > st->st_size ? st->st_size : hole) < 0)
			return -1;
		off = hole;
	}
	if (ftruncate(out, st->st_size) < 0)
		return fail("set size");
	return 0;
}

static int copy_file(int sdir, int ddir, const char *name, const struct stat *st)
{
	/* O_NONBLOCK: an open that would break a lease the frozen workspace holds fails
	 * (EWOULDBLOCK) instead of waiting for it */
	int in = open_same(sdir, name, O_RDONLY | O_NOATIME | O_NONBLOCK, st), out, ret = -1;

	if (in < 0)
		return -1;
	out = openat(ddir, name, O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600);
	if (out < 0) {
		fail("create");
		goto out_in;
	}
	if (copy_data(in, out, st) == 0 && meta_fd(in, out, st) == 0) {
		struct timespec ts[2] = { st->st_atim, st->st_mtim };

		if (futimens(out, ts) < 0)
			fail("set times");
		else
			ret = 0;
	}
	close(out);
out_in:
	close(in);
	return ret;
}

static size_t slot_of(dev_t dev, ino_t ino)
{
	size_t h = (size_t)ino * 0x9E3779B97F4A7C15ull ^ (size_t)dev;

	for (h &= cap_links - 1; links[h].path; h = (h + 1) & (cap_links - 1))
		if (links[h].dev == dev && links[h].ino == ino)
			break;
	return h;
}

/* A second name of an inode already copied: a hard link to the copy (1), else the
 * inode is remembered under this name (0). */
static int linked(int ddir, const char *name, const struct stat *st)
{
	size_t h;

	if (2 * (n_links + 1) > cap_links) {
		struct link_ent *old = links;
		size_t old_cap = cap_links;

		cap_links = cap_links ? 2 * cap_links : 256;
		links = calloc(cap_links, sizeof(*links));
		if (!links)
			return fail("out of memory");
		for (size_t i = 0; i < old_cap; i++)
			if (old[i].path)
				links[slot_of(old[i].dev, old[i].ino)] = old[i];
		free(old);
	}
	h = slot_of(st->st_dev, st->st_ino);
	if (links[h].path) {
		if (linkat(dst_root, links[h].path, ddir, name, 0) < 0)
			return fail("hard link to /%s", links[h].path);
		return 1;
	}
	links[h].path = strdup(rel);
	if (!links[h].path)
		return fail("out of memory");
	links[h].dev = st->st_dev;
	links[h].ino = st->st_ino;
	n_links++;
	return 0;
}

static int copy_dir(int sdir, int ddir);

static int copy_entry(int sdir, int ddir, const char *name)
{
	struct stat st;
	size_t saved;
	int ret = -1;

	if (push(name, &saved) < 0)
		return -1;
	if (!strcmp(rel, ".bunshin/mem")) {
		/* the host makes the layer's anew (live memory files lie in the upper's) */
		ret = 0;
		goto out;
	}
	if (fstatat(sdir, name, &st, AT_SYMLINK_NOFOLLOW) < 0) {
		fail("stat");
		goto out;
	}
	if (!S_ISDIR(st.st_mode) && st.st_nlink > 1) {
		int r = linked(ddir, name, &st);

		if (r != 0) {
			ret = r > 0 ? 0 : -1;
			goto out;
		}
	}
	switch (st.st_mode & S_IFMT) {
	case S_IFDIR: {
		int s, d;

		if (mkdirat(ddir, name, 0700) < 0) {
			fail("make folder");
			break;
		}
		s = open_same(sdir, name, O_RDONLY | O_DIRECTORY, &st);
		if (s < 0)
			break;
		d = openat(ddir, name, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
		if (d < 0) {
			fail("open the copy");
			close(s);
			break;
		}
		if (copy_dir(s, d) == 0 && meta_fd(s, d, &st) == 0) {
			struct timespec ts[2] = { st.st_atim, st.st_mtim };

			if (futimens(d, ts) < 0)
				fail("set times");
			else
				ret = 0;
		}
		close(d);
		close(s);
		break;
	}
	case S_IFREG:
		ret = copy_file(sdir, ddir, name, &st);
		break;
	case S_IFLNK: {
		char target[PATH_MAX + 1];
		ssize_t n = readlinkat(sdir, name, target, sizeof(target) - 1);

		if (n < 0) {
			fail("read symlink");
			break;
		}
		target[n] = 0;
		if (symlinkat(target, ddir, name) < 0) {
			fail("make symlink");
			break;
		}
		ret = meta_path(sdir, ddir, name, &st);
		break;
	}
	case S_IFCHR:
	case S_IFBLK:
	case S_IFIFO:
	case S_IFSOCK:
		if (mknodat(ddir, name, (st.st_mode & S_IFMT) | 0600, st.st_rdev) < 0) {
			fail("make special file");
			break;
		}
		ret = meta_path(sdir, ddir, name, &st);
		break;
	default:
		errno = 0;
		fail("unknown file type %o", st.st_mode & S_IFMT);
	}
out:
	pop(saved);
	return ret;
}

static int copy_dir(int sdir, int ddir)
{
	int fd = dup(sdir);
	DIR *d = fd < 0 ? NULL : fdopendir(fd);
	struct dirent *e;
	int ret = 0;

	if (!d) {
		if (fd >= 0)
			close(fd);
		return fail("list folder");
	}
	for (errno = 0; (e = readdir(d)); errno = 0) {
		if (!strcmp(e->d_name, ".") || !strcmp(e->d_name, ".."))
			continue;
		if (copy_entry(sdir, ddir, e->d_name) < 0) {
			ret = -1;
			break;
		}
	}
	if (ret == 0 && errno)
		ret = fail("list folder");
	closedir(d);
	return ret;
}

/* Copy SRC to the new folder DST (its parent must exist). */
static int copy_root(const char *src, const char *dst)
{
	struct stat st;
	int s, d, ret = -1;

	s = open(src, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
	if (s < 0 || fstat(s, &st) < 0)
		return fail("open %s", src);
	if (mkdir(dst, 0700) < 0) {
		fail("make %s", dst);
		goto out;
	}
	d = open(dst, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
	if (d < 0) {
		fail("open %s", dst);
		goto out;
	}
	dst_root = d;
	if (copy_dir(s, d) == 0 && meta_fd(s, d, &st) == 0) {
		struct timespec ts[2] = { st.st_atim, st.st_mtim };

		if (futimens(d, ts) < 0)
			fail("set times");
		else
			ret = 0;
	}
	close(d);
out:
	close(s);
	return ret;
}

int main(int argc, char **argv)
{
	struct rlimit rl;
	char go;
	int gofd, donefd, ok;

	if (argc != 5) {
		fprintf(stderr, "usage: upper_copy GO DONE SRC DST\n");
		return 2;
	}
	/* two descriptors per level of folders: as deep as the hard limit allows */
	if (getrlimit(RLIMIT_NOFILE, &rl) == 0 && rl.rlim_cur < rl.rlim_max) {
		rl.rlim_cur = rl.rlim_max;
		setrlimit(RLIMIT_NOFILE, &rl);
	}
	/* O_NONBLOCK: a fifo's open waits for its other end, which the caller holds from
	 * before this started until it gives up (then: GO reads EOF, DONE has no reader) */
	gofd = open(argv[1], O_RDONLY | O_NONBLOCK | O_CLOEXEC);
	if (gofd < 0 || fcntl(gofd, F_SETFL, 0) < 0)
		return fail("open %s", argv[1]), 1;
	donefd = open(argv[2], O_WRONLY | O_NONBLOCK | O_CLOEXEC);
	if (donefd < 0 || fcntl(donefd, F_SETFL, 0) < 0)
		return fail("open %s", argv[2]), 1;
	if (read(gofd, &go, 1) != 1)
		return 1; /* the caller gave up */
	umask(0);
	ok = copy_root(argv[3], argv[4]) == 0;
	if (write(donefd, ok ? "0\n" : "1\n", 2) != 2)
		return 1;
	/* end only once the caller closes GO (after the dump): an exit inside the pause wakes
	 * the caller's thread that reaps it, which then competes with the one answering CRIU */
	while (read(gofd, &go, 1) > 0)
		;
	return ok ? 0 : 1;
}
