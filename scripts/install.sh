#!/usr/bin/env bash
# bunshin installer: system packages, a private CRIU >= 4.2, the project's
# virtualenv (.venv) and the `bunshin` command on PATH.
#
# Idempotent; when everything is already in place it takes a few seconds and
# touches no network.
#
# Environment knobs (all optional):
#   PYTHON                  python used to create .venv (default: python3 on PATH, >= 3.11)
#   BUNSHIN_BIN_LINK        where to link the bunshin command (default /usr/local/bin/bunshin)
#   BUNSHIN_CRIU_PREFIX     CRIU prefix (default /opt/bunshin/criu); see install_criu.sh
#   BUNSHIN_FORCE_PIP=1     re-run pip even if nothing changed
#   BUNSHIN_INSTALL_PROFILE what to install beyond the core (library, CLI, server), comma-separated
#                           extras: test, docs, adapters, cluster, desktop, e2b; `all` (the default,
#                           what the test suite needs) or `core` (none). `make install-core` etc.
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PYTHON=${PYTHON:-python3}
VENV=$REPO/.venv
BIN_LINK=${BUNSHIN_BIN_LINK:-/usr/local/bin/bunshin}
CRIU_PREFIX=${BUNSHIN_CRIU_PREFIX:-/opt/bunshin/criu}
PYCRIU_DIR=$CRIU_PREFIX/root/usr/lib/python3/dist-packages
MIN_PY=3.11
PROFILE=${BUNSHIN_INSTALL_PROFILE:-all}
case "$PROFILE" in
    all) EXTRAS=test,docs,adapters,cluster,desktop,e2b ;;
    core | "") EXTRAS= ;;
    *) EXTRAS=$PROFILE ;;
esac
has_extra() { case ",$EXTRAS," in *",$1,"*) return 0 ;; *) return 1 ;; esac; }

say() { printf '==> %s\n' "$*"; }
die() {
    printf 'install: error: %s\n' "$1" >&2
    shift
    local line
    for line in "$@"; do printf '    %s\n' "$line" >&2; done
    exit 1
}

# ---------------------------------------------------------------------------
# 0. Preconditions
# ---------------------------------------------------------------------------
[ "$(id -u)" = 0 ] ||
    die "bunshin needs root (namespaces, mounts, cgroups, CRIU)" "Run: sudo make install"
if ! command -v apt-get >/dev/null 2>&1 || ! command -v dpkg-query >/dev/null 2>&1; then
    die "apt-get/dpkg not found" "This installer supports Debian 12 and 13."
fi
command -v "$PYTHON" >/dev/null 2>&1 ||
    die "'$PYTHON' not found on PATH" "Install Python >= $MIN_PY, or set PYTHON=/path/to/python3.11"
PYTHON=$(command -v "$PYTHON")
py_ver=$("$PYTHON" -c 'import sys; print("%d.%d" % sys.version_info[:2])') ||
    die "'$PYTHON' does not run"
[ "$(printf '%s\n%s\n' "$MIN_PY" "$py_ver" | sort -V | head -n1)" = "$MIN_PY" ] ||
    die "$PYTHON is Python $py_ver; bunshin needs >= $MIN_PY" \
        "Put a Python >= $MIN_PY first on PATH, or set PYTHON=/path/to/python3.x"

# ---------------------------------------------------------------------------
# 1. System packages
# ---------------------------------------------------------------------------
WANT=(   # the core: workspaces, forks, images
    iproute2
    nftables
    util-linux
    busybox-static
    procps
    gcc              # builds the SIGSYS handler of converted memory (memfile/sigsys.c) and the tests' C programs
    skopeo           # image pulls (and the image tests' format conversions)
    buildah          # bunshin image build (Dockerfiles)
    runc             # buildah's RUN steps (--isolation oci, in a user namespace)
)
if has_extra desktop || has_extra test; then
    # desktops (bunshin create --desktop; host-image workspaces see the host's /usr)
    WANT+=(xvfb x11-apps x11-utils xdotool jwm openbox x11vnc socat)
fi
if has_extra e2b || has_extra test; then
    # what e2b_desktop.Sandbox runs in the `desktop` template (the host image): XFCE (its
    # session starts under dbus-launch), scrot (screenshots), xrandr, gtk-launch (launch)
    WANT+=(xvfb x11-utils xdotool xfce4-session xfwm4 xfdesktop4 dbus-x11 scrot x11-xserver-utils libgtk-3-bin)
    # and its stream (Sandbox.stream): x11vnc, noVNC (the template names it /opt/noVNC), websockify, netstat
    WANT+=(x11vnc novnc websockify net-tools)
fi
if has_extra test; then
    WANT+=(
        libjemalloc2     # an allocator test
        docker-registry  # the image tests' loopback registry
        zstd             # the image tests' .tar.zst archives
        python3          # the image tests copy Debian's python into a layer
        xterm tk dillo mousepad gnumeric  # the desktop tests' apps: terminal, editors (xedit, in x11-apps;
        firefox-esr chromium              # mousepad), Tk, browsers (dillo, Firefox, Chromium), a spreadsheet
        libglib2.0-bin   # gio monitor: GLib's file monitor (inotify), forked in test_fork_inotify
        passt            # pasta: `bunshin bench network` compares it with veth + nftables
    )
fi
# The python needs a working venv module (Debian's python3 splits it out).
need_venv_pkg=0
if ! "$PYTHON" -c 'import venv, ensurepip' >/dev/null 2>&1; then
    case "$(readlink -f "$PYTHON")" in
        /usr/bin/python3*)
            need_venv_pkg=1
            WANT+=("python3.${py_ver#*.}-venv" python3-venv) ;;
        *)
            die "$PYTHON has no working 'venv'/'ensurepip' module" \
                "Rebuild/reinstall that Python with ensurepip, or set PYTHON to one that has it." ;;
    esac
fi

pkg_installed() {
    [ "$(dpkg-query -W -f='${db:Status-Status}' "$1" 2>/dev/null || true)" = installed ]
}
missing=()
for p in "${WANT[@]}"; do
    pkg_installed "$p" || missing+=("$p")
done
if [ "${#missing[@]}" -gt 0 ]; then
    say "installing system packages: ${missing[*]}"
    export DEBIAN_FRONTEND=noninteractive
    # Refresh the index (a stale one gives 404s); tolerate unrelated broken sources.
    if ! apt-get -qq update >/tmp/bunshin-apt-update.log 2>&1; then
        printf 'install: warning: apt-get update reported problems:\n' >&2
        tail -n 5 /tmp/bunshin-apt-update.log >&2 || true
    fi
    rm -f /tmp/bunshin-apt-update.log
    if ! apt-get install -y -qq --no-install-recommends "${missing[@]}" \
            >/tmp/bunshin-apt-install.log 2>&1; then
        cat /tmp/bunshin-apt-install.log >&2
        rm -f /tmp/bunshin-apt-install.log
        die "apt-get install ${missing[*]} failed" \
            "Fix the apt error above (network to the Debian mirror? dpkg lock?) and re-run 'make install'."
    fi
    rm -f /tmp/bunshin-apt-install.log
else
    say "system packages present: ${WANT[*]}"
fi
if [ "$need_venv_pkg" = 1 ] && ! "$PYTHON" -c 'import venv, ensurepip' >/dev/null 2>&1; then
    die "$PYTHON still cannot create virtualenvs after installing python3-venv"
fi
for cmd in ip nft unshare nsenter mount busybox ps; do
    command -v "$cmd" >/dev/null 2>&1 || [ -x "/bin/$cmd" ] || [ -x "/sbin/$cmd" ] ||
        die "'$cmd' is still missing after installing the system packages"
done

# The pid space: every live workspace's pids limit is counted against kernel.pid_max
# (bunshin.runtime.state.budget), and the kernel's default (32768) holds ~57 workspaces of the
# default 512. systemd raises it to 4194304 (the 64-bit maximum) on every boot
# (50-pid-max.conf); a host without systemd gets the same here, never a lower value.
if [ "$(cat /proc/sys/kernel/pid_max 2>/dev/null || echo 0)" -lt 4194304 ]; then
    if sysctl -q -w kernel.pid_max=4194304 >/dev/null 2>&1; then
        say "kernel.pid_max raised to 4194304 (as systemd does): room for thousands of workspaces"
    else
        printf 'install: warning: could not raise kernel.pid_max (%s); bunshin refuses workspaces past it\n' \
            "$(cat /proc/sys/kernel/pid_max)" >&2
    fi
fi

# ---------------------------------------------------------------------------
# 2. CRIU >= 4.2 in a private prefix
# ---------------------------------------------------------------------------
PYTHON=$PYTHON BUNSHIN_CRIU_PREFIX=$CRIU_PREFIX bash "$REPO/scripts/install_criu.sh"

# ---------------------------------------------------------------------------
# 3. Virtualenv with the project (editable) and pycriu
# ---------------------------------------------------------------------------
venv_ok() {
    [ -x "$VENV/bin/python" ] &&
        "$VENV/bin/python" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else 1)' \
            >/dev/null 2>&1
}
if venv_ok; then
    say "reusing virtualenv $VENV"
else
    if [ -e "$VENV" ]; then
        say "recreating broken virtualenv $VENV"
        rm -rf "$VENV"
    else
        say "creating virtualenv $VENV (Python $py_ver)"
    fi
    "$PYTHON" -m venv "$VENV" || die "'$PYTHON -m venv $VENV' failed"
fi

# Re-run pip only when pyproject.toml (or the python) changed since last time.
STAMP=$VENV/.bunshin-install-stamp
want_stamp=$( { sha256sum "$REPO/pyproject.toml"; "$VENV/bin/python" -VV; echo "$EXTRAS"; } | sha256sum | cut -d' ' -f1)
SPEC=.${EXTRAS:+[$EXTRAS]}
PROBE=bunshin
has_extra test && PROBE="$PROBE, pytest, ruff"
has_extra docs && PROBE="$PROBE, mkdocs"
if [ "${BUNSHIN_FORCE_PIP:-0}" != 1 ] && [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$want_stamp" ] &&
        [ -x "$VENV/bin/bunshin" ] &&
        (cd / && "$VENV/bin/python" -c "import $PROBE" >/dev/null 2>&1); then
    say "python packages up to date"
else
    say "installing bunshin (profile ${PROFILE}) into $VENV (pip install -e '$SPEC')"
    rm -f "$STAMP"
    (cd "$REPO" && "$VENV/bin/python" -m pip install -q --disable-pip-version-check -e "$SPEC") ||
        die "pip install -e '$SPEC' failed" "Check network access to PyPI and re-run 'make install'."
    printf '%s\n' "$want_stamp" >"$STAMP"
fi

# pycriu (pure Python, from python3-pycriu) lives in the CRIU prefix.
SITE=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
[ -d "$PYCRIU_DIR/pycriu" ] || die "pycriu not found in $PYCRIU_DIR" \
    "Reinstall CRIU: BUNSHIN_CRIU_FORCE=1 make install"
for f in "$SITE"/*pycriu*.pth; do
    [ -e "$f" ] || continue
    [ "$f" = "$SITE/bunshin-pycriu.pth" ] || rm -f "$f"
done
if [ "$(cat "$SITE/bunshin-pycriu.pth" 2>/dev/null || true)" != "$PYCRIU_DIR" ]; then
    printf '%s\n' "$PYCRIU_DIR" >"$SITE/bunshin-pycriu.pth"
fi
if ! out=$(cd / && "$VENV/bin/python" -c 'import pycriu, google.protobuf as p; print(p.__version__)' 2>&1); then
    printf '%s\n' "$out" >&2
    die "'import pycriu' fails in $VENV" "pycriu needs protobuf<6; try: BUNSHIN_FORCE_PIP=1 make install"
fi
say "pycriu importable (protobuf $out)"

# ---------------------------------------------------------------------------
# 4. The bunshin command on PATH
# ---------------------------------------------------------------------------
[ -x "$VENV/bin/bunshin" ] || die "$VENV/bin/bunshin was not created by pip"
if [ "$(readlink "$BIN_LINK" 2>/dev/null || true)" != "$VENV/bin/bunshin" ]; then
    mkdir -p "$(dirname "$BIN_LINK")"
    ln -sfn "$VENV/bin/bunshin" "$BIN_LINK"
fi
say "bunshin command: $BIN_LINK -> $VENV/bin/bunshin"
say "install done (CRIU: $CRIU_PREFIX/bin/criu)"
