"""A command on a pseudo-terminal, relayed through the run's files (runs INSIDE the workspace).

Run by the agent's own Python (standard library only) as
``ptyrelay.py <size file> <rows> <cols> <argv...>``: the command gets a new session whose
controlling terminal is a new pty of that size; what the terminal shows goes to this
process's stdout (the run's ``out`` file), what comes on its stdin (the run's FIFO) is
typed into the terminal. On SIGWINCH the size is read again from the size file (``rows
cols``) and set on the terminal, which sends the command its own SIGWINCH. The relay ends
with the command, with its exit status (128 + signal for a signal).
"""

import fcntl
import os
import select
import signal
import struct
import sys
import termios

#: Variables of the agent's Python that the command must not inherit.
DROP = ("PYTHONHOME", "PYTHONPATH", "PYTHONDONTWRITEBYTECODE", "PYTHONUTF8", "PYTHONCOERCECLOCALE")


def set_size(fd, rows, cols):
    fcntl.ioctl(fd, termios.TIOCSWINSZ, struct.pack("HHHH", rows, cols, 0, 0))


def child(slave, argv):
    signal.pthread_sigmask(signal.SIG_SETMASK, [])
    signal.signal(signal.SIGWINCH, signal.SIG_DFL)
    os.setsid()
    fcntl.ioctl(slave, termios.TIOCSCTTY, 0)
    for fd in (0, 1, 2):
        os.dup2(slave, fd)
    if slave > 2:
        os.close(slave)
    env = {k: v for k, v in os.environ.items() if k not in DROP}
    try:
        os.execvpe(argv[0], argv, env)
    except OSError as e:
        os.write(2, f"{argv[0]}: {e.strerror}\r\n".encode())
        os._exit(127)


def main():
    size_file, rows, cols, argv = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4:]
    master, slave = os.openpty()
    set_size(slave, rows, cols)
    pid = os.fork()
    if pid == 0:
        os.close(master)
        child(slave, argv)
    os.close(slave)

    def resize(*_):
        try:
            with open(size_file) as f:
                r, c = (int(x) for x in f.read().split()[:2])
            set_size(master, r, c)
        except (OSError, ValueError):
            pass

    signal.signal(signal.SIGWINCH, resize)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, [signal.SIGWINCH])
    resize()  # a resize asked for before the handler was there (its signal was ignored then)
    stdin_open = True
    while True:
        watch = [master] + ([0] if stdin_open else [])
        try:
            ready, _, _ = select.select(watch, [], [])
        except InterruptedError:
            continue
        if master in ready:
            try:
                data = os.read(master, 65536)
            except OSError:  # EIO: every holder of the terminal's other side is gone
                data = b""
            if not data:
                break
            os.write(1, data)
        if 0 in ready:
            data = os.read(0, 65536)
            if data:
                os.write(master, data)
            else:
                stdin_open = False
    _, status = os.waitpid(pid, 0)
    os._exit(os.waitstatus_to_exitcode(status) if os.WIFEXITED(status) else 128 + os.WTERMSIG(status))


if __name__ == "__main__":
    main()
