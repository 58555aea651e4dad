#!/usr/bin/env bash
# Install a CRIU >= 4.2 into a private prefix (default /opt/bunshin/criu),
# without touching the system's criu or apt setup.
#
# Debian 12 ships CRIU 3.17 (fails `criu check` on recent kernels) and Debian 13
# ships 4.1.1 (cannot dump TCP/UDP sockets on kernels >= 6.16). So we fetch the
# criu package and its whole library closure (libc and ld.so included) from
# Debian unstable through a private apt state, unpack them with `dpkg -x`, and
# run criu through the prefix's own dynamic loader. Then we verify it for real:
# `criu check` plus a dump and restore of a process holding a listening TCP
# socket.
#
# Idempotent: if the prefix holds a verified CRIU >= the wanted version (stamp
# file), nothing is done and nothing is fetched.
#
# Environment knobs (all optional):
#   BUNSHIN_CRIU_PREFIX   install prefix               (default /opt/bunshin/criu)
#   BUNSHIN_CRIU_SUITE    Debian suite to take it from (default sid)
#   BUNSHIN_CRIU_MIN      minimum acceptable version   (default 4.2)
#   BUNSHIN_DEBIAN_MIRROR Debian mirror URI            (default: from the system's apt sources)
#   BUNSHIN_CRIU_FORCE=1  reinstall even if already verified
#   PYTHON                python used for the dump/restore test (default python3)
set -euo pipefail

PREFIX=${BUNSHIN_CRIU_PREFIX:-/opt/bunshin/criu}
SUITE=${BUNSHIN_CRIU_SUITE:-sid}
MIN_VERSION=${BUNSHIN_CRIU_MIN:-4.2}
PYTHON=${PYTHON:-python3}
STAMP_NAME=.bunshin-verified
KEYRING=/usr/share/keyrings/debian-archive-keyring.gpg

say() { printf '==> %s\n' "$*"; }
note() { printf '    %s\n' "$*"; }
die() {
    printf 'install_criu: error: %s\n' "$1" >&2
    shift
    local line
    for line in "$@"; do printf '    %s\n' "$line" >&2; done
    exit 1
}

# version_ge A B: true if version A >= B (numeric dotted compare).
version_ge() {
    [ "$(printf '%s\n%s\n' "$2" "$1" | sort -V | head -n1)" = "$2" ]
}

# criu_version WRAPPER: print "X.Y[.Z]" from `criu --version`, or nothing.
criu_version() {
    "$1" --version 2>/dev/null | sed -n 's/^Version: *\([0-9][0-9.]*\).*/\1/p' | head -n1
}

multiarch_triplet() {
    local t=""
    if command -v dpkg-architecture >/dev/null 2>&1; then
        t=$(dpkg-architecture -qDEB_HOST_MULTIARCH 2>/dev/null || true)
    fi
    if [ -z "$t" ] && command -v gcc >/dev/null 2>&1; then
        t=$(gcc -print-multiarch 2>/dev/null || true)
    fi
    if [ -z "$t" ] && command -v dpkg >/dev/null 2>&1; then
        case "$(dpkg --print-architecture 2>/dev/null || true)" in
            amd64) t=x86_64-linux-gnu ;;
            arm64) t=aarch64-linux-gnu ;;
            ppc64el) t=powerpc64le-linux-gnu ;;
            s390x) t=s390x-linux-gnu ;;
        esac
    fi
    printf '%s\n' "${t:-x86_64-linux-gnu}"
}

# Print the URI of the system's main Debian archive, taken from its apt sources:
# the first enabled "deb" source whose suites include the release's codename
# (so not -security / -updates, and not third-party repositories).
debian_mirror() {
    if [ -n "${BUNSHIN_DEBIAN_MIRROR:-}" ]; then
        printf '%s\n' "$BUNSHIN_DEBIAN_MIRROR"
        return 0
    fi
    local codename=""
    if [ -r /etc/os-release ]; then
        # shellcheck disable=SC1091
        codename=$(. /etc/os-release && printf '%s' "${VERSION_CODENAME:-}")
    fi
    local files=() f
    for f in /etc/apt/sources.list.d/debian.sources /etc/apt/sources.list.d/*.sources \
             /etc/apt/sources.list /etc/apt/sources.list.d/*.list; do
        [ -f "$f" ] && files+=("$f")
    done
    [ "${#files[@]}" -gt 0 ] || return 0
    # awk handles both formats: deb822 stanzas (*.sources) and one-line entries.
    awk -v codename="$codename" '
        function suite_ok(s) {
            return (codename != "" && s == codename) || s ~ /^(stable|testing|unstable|sid)$/
        }
        function flush() {
            if (uri != "" && uri !~ /^cdrom:/ && types ~ /(^|[ \t])deb([ \t]|$)/ && enabled != "no") {
                n = split(suites, ss, /[ \t]+/)
                for (i = 1; i <= n; i++) if (suite_ok(ss[i])) { print uri; found = 1; exit }
                if (fallback == "" && uri ~ /\/debian\/?$/ && suites !~ /security/) fallback = uri
            }
            uri = ""; types = ""; suites = ""; enabled = ""
        }
        FNR == 1 { flush(); deb822 = (FILENAME ~ /\.sources$/) }
        deb822 {
            if ($0 ~ /^[ \t]*$/) { flush(); next }
            if ($0 ~ /^[ \t]*#/) next
            line = $0; sub(/^[ \t]+/, "", line)
            key = tolower(line); sub(/:.*/, "", key)
            val = line; sub(/^[^:]*:[ \t]*/, "", val)
            if (key == "uris") { split(val, us, /[ \t]+/); uri = us[1] }
            else if (key == "types") types = val
            else if (key == "suites") suites = val
            else if (key == "enabled") enabled = tolower(val)
            next
        }
        /^[ \t]*deb[ \t]/ {
            line = $0; sub(/^[ \t]*deb[ \t]+/, "", line)
            if (line ~ /^\[/) sub(/^\[[^]]*\][ \t]*/, "", line)
            split(line, parts, /[ \t]+/)
            uri = parts[1]; suites = parts[2]; types = "deb"; enabled = ""
            flush()
        }
        END { if (!found) { flush(); if (!found && fallback != "") print fallback } }
    ' "${files[@]}" | head -n1
}

# ---------------------------------------------------------------------------
# verify_criu WRAPPER: `criu check`, then dump + restore a live process that
# holds a listening TCP socket; the restored process must keep counting and
# answer a connection. Leaves nothing behind.
# ---------------------------------------------------------------------------
VERIFY_DIR=""
VERIFY_PID=""
# alive PID: the process exists and is not a zombie (a killed or dumped process
# may stay a zombie until whoever inherited it reaps it).
alive() {
    local st
    st=$(sed -n 's/^State:[[:space:]]*\([A-Z]\).*/\1/p' "/proc/$1/status" 2>/dev/null) || return 1
    [ -n "$st" ] && [ "$st" != Z ] && [ "$st" != X ]
}
NANNY_PID=""
verify_cleanup() {
    if [ -n "$NANNY_PID" ]; then
        kill -KILL "$NANNY_PID" 2>/dev/null || true
        wait "$NANNY_PID" 2>/dev/null || true
    fi
    NANNY_PID=""
    if [ -n "$VERIFY_PID" ] && alive "$VERIFY_PID"; then
        kill -KILL "$VERIFY_PID" 2>/dev/null || true
        for _ in $(seq 50); do alive "$VERIFY_PID" || break; sleep 0.05; done
    fi
    VERIFY_PID=""
    if [ -n "$VERIFY_DIR" ]; then rm -rf "$VERIFY_DIR"; fi
    VERIFY_DIR=""
}

verify_fail() {
    local what=$1 log=${2:-}
    if [ -n "$log" ] && [ -f "$log" ]; then
        printf -- '--- last lines of %s ---\n' "$(basename "$log")" >&2
        tail -n 25 "$log" >&2 || true
        printf -- '---\n' >&2
    fi
    verify_cleanup
    if [ "$VERIFY_MODE" = recheck ]; then
        die "CRIU verification failed: $what" \
            "The CRIU in $PREFIX was verified on kernel $STAMP_KERNEL but does not work on $(uname -r)." \
            "Reinstall it (perhaps a newer CRIU is needed): BUNSHIN_CRIU_FORCE=1 make install"
    fi
    die "CRIU verification failed: $what" \
        "CRIU ${got:-?} from Debian $SUITE does not work on this machine (kernel $(uname -r)); nothing was installed." \
        "Check that you run as root on the host (not in an unprivileged container)," \
        "that 'criu check' passes, then re-run 'make install'." \
        "Set BUNSHIN_CRIU_SUITE to take CRIU from another Debian suite if needed."
}
VERIFY_MODE=install
STAMP_KERNEL=""

# The test program: close every inherited fd (leaked fds from outside make the
# dump fail), listen on 127.0.0.1, keep a counter file up to date, answer
# connections with "bunshin-ok".
VERIFY_PROG='
import os, socket, sys
os.closerange(3, 65536)
d = sys.argv[1]
s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("127.0.0.1", 0))
s.listen(8)
s.settimeout(0.05)
with open(d + "/port.tmp", "w") as f:
    f.write(str(s.getsockname()[1]))
os.replace(d + "/port.tmp", d + "/port")
n = 0
while True:
    n += 1
    with open(d + "/counter.tmp", "w") as f:
        f.write(str(n))
    os.replace(d + "/counter.tmp", d + "/counter")
    try:
        c, _ = s.accept()
    except (socket.timeout, BlockingIOError):
        continue
    c.sendall(b"bunshin-ok\n")
    c.close()
'

# Nanny: start VERIFY_PROG in a new session with stdio on /dev/null, write its
# pid to a file, and reap it as soon as it dies (CRIU kills it after the dump;
# its pid must be free again before the restore, which reuses it).
VERIFY_NANNY='
import os, subprocess, sys
p = subprocess.Popen([sys.executable, "-c", sys.argv[1], sys.argv[2]],
                     stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                     stderr=subprocess.DEVNULL, start_new_session=True,
                     close_fds=True, cwd="/")
with open(sys.argv[3] + ".tmp", "w") as f:
    f.write(str(p.pid))
os.replace(sys.argv[3] + ".tmp", sys.argv[3])
p.wait()
'

VERIFY_PROBE='
import socket, sys
c = socket.create_connection(("127.0.0.1", int(sys.argv[1])), timeout=5)
c.settimeout(5)
data = b""
while not data.endswith(b"\n"):
    chunk = c.recv(64)
    if not chunk:
        break
    data += chunk
sys.exit(0 if data == b"bunshin-ok\n" else 1)
'

read_counter() { cat "$VERIFY_DIR/state/counter" 2>/dev/null || echo 0; }

verify_criu() {
    local criu=$1 c0 c1 port
    VERIFY_DIR=$(mktemp -d /tmp/bunshin-criu-verify.XXXXXX)
    mkdir -p "$VERIFY_DIR/state" "$VERIFY_DIR/img"

    note "criu check"
    if ! "$criu" check >"$VERIFY_DIR/check.log" 2>&1; then
        verify_fail "'criu check' failed" "$VERIFY_DIR/check.log"
    fi

    note "dump + restore of a process with a listening TCP socket"
    "$PYTHON" -c "$VERIFY_NANNY" "$VERIFY_PROG" "$VERIFY_DIR/state" "$VERIFY_DIR/pid" \
        </dev/null >"$VERIFY_DIR/nanny.log" 2>&1 &
    NANNY_PID=$!
    for _ in $(seq 100); do
        [ -s "$VERIFY_DIR/pid" ] && break
        alive "$NANNY_PID" || verify_fail "could not start the test process with $PYTHON" "$VERIFY_DIR/nanny.log"
        sleep 0.05
    done
    VERIFY_PID=$(cat "$VERIFY_DIR/pid" 2>/dev/null) ||
        verify_fail "could not start the test process with $PYTHON" "$VERIFY_DIR/nanny.log"
    for _ in $(seq 100); do
        [ -s "$VERIFY_DIR/state/port" ] && [ "$(read_counter)" -gt 2 ] && break
        alive "$VERIFY_PID" || verify_fail "the test process died before the dump"
        sleep 0.05
    done
    [ -s "$VERIFY_DIR/state/port" ] || verify_fail "the test process did not start listening"
    port=$(cat "$VERIFY_DIR/state/port")

    if ! "$criu" dump -t "$VERIFY_PID" -D "$VERIFY_DIR/img" -o dump.log -v4 \
            >"$VERIFY_DIR/dump.out" 2>&1; then
        verify_fail "'criu dump' failed" "$VERIFY_DIR/img/dump.log"
    fi
    # Wait until the pid is free (process dead and reaped by the nanny).
    for _ in $(seq 100); do [ -e "/proc/$VERIFY_PID" ] || break; sleep 0.02; done
    alive "$VERIFY_PID" && verify_fail "the dumped process is still running"
    [ -e "/proc/$VERIFY_PID" ] && verify_fail "pid $VERIFY_PID of the dumped process was not released"
    wait "$NANNY_PID" 2>/dev/null || true
    NANNY_PID=""
    c0=$(read_counter)

    if ! "$criu" restore -D "$VERIFY_DIR/img" -d -o restore.log -v4 \
            >"$VERIFY_DIR/restore.out" 2>&1; then
        verify_fail "'criu restore' failed" "$VERIFY_DIR/img/restore.log"
    fi
    alive "$VERIFY_PID" ||
        verify_fail "the restored process (pid $VERIFY_PID) is not alive" "$VERIFY_DIR/img/restore.log"
    c1=$c0
    for _ in $(seq 100); do
        c1=$(read_counter)
        [ "$c1" -gt "$c0" ] && break
        sleep 0.05
    done
    [ "$c1" -gt "$c0" ] ||
        verify_fail "the restored process does not run (counter stuck at $c0)" "$VERIFY_DIR/img/restore.log"
    "$PYTHON" -c "$VERIFY_PROBE" "$port" ||
        verify_fail "the restored process does not answer on its TCP socket" "$VERIFY_DIR/img/restore.log"

    verify_cleanup
}

# ---------------------------------------------------------------------------
# Already done?
# ---------------------------------------------------------------------------
WRAPPER=$PREFIX/bin/criu
if [ "${BUNSHIN_CRIU_FORCE:-0}" != 1 ] && [ -x "$WRAPPER" ] && [ -f "$PREFIX/$STAMP_NAME" ]; then
    have=$(criu_version "$WRAPPER" || true)
    stamped=$(sed -n 's/^version=//p' "$PREFIX/$STAMP_NAME" | head -n1)
    STAMP_KERNEL=$(sed -n 's/^kernel=//p' "$PREFIX/$STAMP_NAME" | head -n1)
    if [ -n "$have" ] && [ "$have" = "$stamped" ] && version_ge "$have" "$MIN_VERSION"; then
        if [ "$STAMP_KERNEL" != "$(uname -r)" ]; then
            # Verified under another kernel: check again (no download needed).
            say "re-verifying CRIU $have on kernel $(uname -r) (verified on ${STAMP_KERNEL:-?})"
            VERIFY_MODE=recheck
            trap 'verify_cleanup' EXIT
            verify_criu "$WRAPPER"
            trap - EXIT
            sed -i "s/^kernel=.*/kernel=$(uname -r)/" "$PREFIX/$STAMP_NAME"
            grep -q '^kernel=' "$PREFIX/$STAMP_NAME" || printf 'kernel=%s\n' "$(uname -r)" >>"$PREFIX/$STAMP_NAME"
        fi
        say "CRIU $have already installed in $PREFIX (verified)"
        exit 0
    fi
fi

# ---------------------------------------------------------------------------
# Preconditions
# ---------------------------------------------------------------------------
[ "$(id -u)" = 0 ] || die "must run as root (CRIU needs it): sudo make install"
for tool in apt-get apt-cache dpkg sort sed awk; do
    command -v "$tool" >/dev/null 2>&1 ||
        die "'$tool' not found" "This installer needs a Debian-based system (Debian 12 or 13)."
done
command -v "$PYTHON" >/dev/null 2>&1 || die "'$PYTHON' not found (needed to verify CRIU)"
[ -r "$KEYRING" ] ||
    die "$KEYRING is missing" "Install it with: apt-get install debian-archive-keyring"

MIRROR=$(debian_mirror)
[ -n "$MIRROR" ] ||
    die "cannot find the Debian mirror in /etc/apt/sources.list{,.d/*}" \
        "Set BUNSHIN_DEBIAN_MIRROR to your Debian mirror URI (the one serving bookworm/trixie/sid)."
TRIPLET=$(multiarch_triplet)

# ---------------------------------------------------------------------------
# Private apt state for the $SUITE archive
# ---------------------------------------------------------------------------
PARENT=$(dirname "$PREFIX")
NAME=$(basename "$PREFIX")
WORK=$PARENT/.$NAME-build        # kept on failure (apt lists are reused on retry)
STAGE=$PARENT/.$NAME-stage
mkdir -p "$WORK/apt/lists/partial" "$WORK/apt/cache/archives/partial" "$WORK/debs"
# Let apt's unprivileged download user write there (avoids the sandbox warning).
if id _apt >/dev/null 2>&1; then
    chown _apt:root "$WORK/apt/lists/partial" "$WORK/apt/cache/archives/partial" "$WORK/debs" 2>/dev/null || true
fi
printf 'deb [signed-by=%s] %s %s main\n' "$KEYRING" "$MIRROR" "$SUITE" >"$WORK/apt/sources.list"

APT_OPTS=(
    -oDir::Etc::SourceList="$WORK/apt/sources.list"
    -oDir::Etc::SourceParts=/dev/null
    -oDir::Etc::Preferences=/dev/null
    -oDir::Etc::PreferencesParts=/dev/null
    -oDir::State::Lists="$WORK/apt/lists"
    -oDir::Cache="$WORK/apt/cache"
    -oAPT::Get::List-Cleanup=true
)

say "fetching the package index of Debian $SUITE from $MIRROR (private apt state)"
if ! apt-get "${APT_OPTS[@]}" -qq update >"$WORK/apt-update.log" 2>&1 ||
        grep -q '^\(E\|Err\):' "$WORK/apt-update.log"; then
    cat "$WORK/apt-update.log" >&2
    die "apt-get update of Debian $SUITE from $MIRROR failed" \
        "Check network access to $MIRROR, or set BUNSHIN_DEBIAN_MIRROR."
fi

CANDIDATE=$(apt-cache "${APT_OPTS[@]}" policy criu 2>/dev/null |
    sed -n 's/^ *Candidate: *//p' | head -n1)
case "$CANDIDATE" in
    ""|"(none)") die "no criu package in Debian $SUITE at $MIRROR" ;;
esac
UPSTREAM=${CANDIDATE#*:}
UPSTREAM=${UPSTREAM%%-*}
UPSTREAM=${UPSTREAM%%[+~]*}
version_ge "$UPSTREAM" "$MIN_VERSION" ||
    die "Debian $SUITE offers criu $CANDIDATE, older than the required $MIN_VERSION" \
        "Set BUNSHIN_CRIU_SUITE to a suite with criu >= $MIN_VERSION (e.g. experimental)," \
        "or BUNSHIN_DEBIAN_MIRROR to an up-to-date mirror (a dated snapshot may be too old)."

say "installing CRIU $UPSTREAM into $PREFIX"

# Package closure of criu (real packages only; virtual ones are shown as <name>).
mapfile -t PKGS < <(
    apt-cache "${APT_OPTS[@]}" depends --recurse --no-recommends --no-suggests \
        --no-conflicts --no-breaks --no-replaces --no-enhances --no-pre-depends criu |
        grep -v '^ ' | grep -v '<' | sort -u
)
[ "${#PKGS[@]}" -gt 0 ] || die "could not compute the dependency closure of criu"

# The pure-Python image library (python3-pycriu; older suites call it python3-criu).
PYPKG=""
for cand in python3-pycriu python3-criu; do
    c=$(apt-cache "${APT_OPTS[@]}" policy "$cand" 2>/dev/null | sed -n 's/^ *Candidate: *//p' | head -n1)
    if [ -n "$c" ] && [ "$c" != "(none)" ]; then PYPKG=$cand; break; fi
done
# (Old suites ship pycriu inside the criu package itself.)
note "${#PKGS[@]} packages${PYPKG:+ + $PYPKG}"

rm -f "$WORK/debs/"*.deb
(
    cd "$WORK/debs"
    apt-get "${APT_OPTS[@]}" -qq download "${PKGS[@]}" ${PYPKG:+"$PYPKG"} \
        >"$WORK/apt-download.log" 2>&1
) || {
    cat "$WORK/apt-download.log" >&2
    die "downloading the criu packages from $MIRROR failed" "Re-run 'make install' (downloads are retried)."
}

# Unpack everything into a staging prefix, verify it, then swap it in place.
# The staging prefix is removed if anything fails from here on.
rm -rf "$STAGE"
trap 'verify_cleanup; rm -rf "$STAGE"' EXIT
mkdir -p "$STAGE/root" "$STAGE/bin"
for deb in "$WORK/debs/"*.deb; do
    dpkg -x "$deb" "$STAGE/root" || die "dpkg -x failed on $(basename "$deb")"
done

LIBDIR=usr/lib/$TRIPLET
LDSO=""
for cand in "$STAGE/root/$LIBDIR"/ld-linux*.so.* "$STAGE/root/lib/$TRIPLET"/ld-linux*.so.* \
            "$STAGE/root/$LIBDIR"/ld64.so.* ; do
    if [ -e "$cand" ]; then LDSO=${cand#"$STAGE/root/"}; break; fi
done
[ -n "$LDSO" ] || die "no dynamic loader found in the unpacked libc6 ($STAGE/root/$LIBDIR)"
[ -x "$STAGE/root/usr/sbin/criu" ] || die "the criu package did not provide usr/sbin/criu"

# The wrapper finds its root relative to itself, so the prefix can be moved.
cat >"$STAGE/bin/criu" <<EOF
#!/bin/sh
# CRIU $UPSTREAM (Debian $SUITE $CANDIDATE) in a private prefix, run through the
# prefix's own dynamic loader and libraries. Generated by bunshin scripts/install_criu.sh.
here=\$(dirname "\$(readlink -f "\$0")")
ROOT=\${here%/bin}/root
exec "\$ROOT/$LDSO" --library-path "\$ROOT/$LIBDIR:\$ROOT/lib/$TRIPLET" \\
    "\$ROOT/usr/sbin/criu" "\$@"
EOF
chmod 755 "$STAGE/bin/criu"

got=$(criu_version "$STAGE/bin/criu" || true)
if [ -z "$got" ]; then
    "$STAGE/bin/criu" --version >&2 || true
    die "the unpacked criu does not run" "See the output above; re-run with BUNSHIN_CRIU_FORCE=1 after fixing."
fi
version_ge "$got" "$MIN_VERSION" || die "unpacked criu reports version $got (< $MIN_VERSION)"

say "verifying CRIU $got"
verify_criu "$STAGE/bin/criu"

{
    printf 'version=%s\n' "$got"
    printf 'package=%s\n' "$CANDIDATE"
    printf 'suite=%s\n' "$SUITE"
    printf 'mirror=%s\n' "$MIRROR"
    printf 'kernel=%s\n' "$(uname -r)"
    printf 'verified=%s\n' "$(date -u +%Y-%m-%dT%H:%M:%SZ)"
} >"$STAGE/$STAMP_NAME"

# Swap in.
if [ -e "$PREFIX" ]; then
    rm -rf "$PARENT/.$NAME-old"
    mv "$PREFIX" "$PARENT/.$NAME-old"
fi
mv "$STAGE" "$PREFIX"
trap - EXIT
rm -rf "$PARENT/.$NAME-old" "$WORK"

# Sanity check after the move (the wrapper is relocatable).
[ "$(criu_version "$WRAPPER")" = "$got" ] || die "$WRAPPER does not run after installation"
say "CRIU $got installed: $WRAPPER"
