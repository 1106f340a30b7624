#!/bin/sh
# Build the aarch64 executable on an x86_64 Debian host, under emulation, and smoke-test it.
#
# PyInstaller cannot cross-build, so this makes a Debian 12 (bookworm) arm64 root with
# debootstrap, runs it through qemu-user-static + binfmt_misc, builds there with the same
# packaging/build.py as on x86_64, then runs tests/test_dist_smoke.py against the aarch64
# binary from the host (QEMU_LD_PREFIX points qemu at the arm64 root's loader and libc).
#
# Usage (as root): packaging/arm64.sh [root|build|smoke|all]     default: all
# Everything lives under build/arm64-root (about 600 MB); `rm -rf build/arm64-root` to start
# over. Timings measured on a 2-core x86_64 host: root ~12 min, pip ~2 min, build ~5 min.
set -eu

cd "$(dirname "$0")/.."
TOP=$(pwd)
ROOT="$TOP/build/arm64-root"
STAGE=${1:-all}
PACKAGES="python3,python3-venv,libpython3.11,binutils,ca-certificates"

say() { echo "arm64: $*" >&2; }
die() { say "$*"; exit 1; }

[ "$(id -u)" -eq 0 ] || die "must run as root (debootstrap, chroot, binfmt_misc)"
[ "$(uname -m)" = x86_64 ] || [ "$(uname -m)" = aarch64 ] || die "unsupported host $(uname -m)"

# The Debian mirror the host already uses (its first deb line), unless MIRROR is set.
host_mirror() {
    sed -n -e 's/^URIs:[[:space:]]*\([^[:space:]]*\).*/\1/p' \
        -e 's/^deb[[:space:]]\{1,\}\(\[[^]]*\][[:space:]]*\)\{0,1\}\([^[:space:]]*\).*/\2/p' \
        /etc/apt/sources.list.d/*.sources /etc/apt/sources.list 2>/dev/null \
        | grep -v -e security -e '^$' | head -n 1
}

need_tools() {
    missing=""
    command -v debootstrap >/dev/null 2>&1 || missing="$missing debootstrap"
    [ -x /usr/bin/qemu-aarch64-static ] || missing="$missing qemu-user-static"
    command -v update-binfmts >/dev/null 2>&1 || missing="$missing binfmt-support"
    if [ -n "$missing" ]; then
        say "installing$missing"
        apt-get update -q && apt-get install -y -q $missing
    fi
}

enable_binfmt() {
    [ "$(uname -m)" = aarch64 ] && return 0
    if [ ! -e /proc/sys/fs/binfmt_misc/register ]; then
        mount -t binfmt_misc binfmt_misc /proc/sys/fs/binfmt_misc
    fi
    update-binfmts --enable qemu-aarch64 2>/dev/null || true
    [ -e /proc/sys/fs/binfmt_misc/qemu-aarch64 ] || die "binfmt_misc has no qemu-aarch64 entry"
}

make_root() {
    if [ -f "$ROOT/.root-done" ]; then
        say "root: $ROOT is there"
        return 0
    fi
    mirror=${MIRROR:-$(host_mirror)}
    [ -n "$mirror" ] || die "no Debian mirror found in /etc/apt; set MIRROR"
    say "root: debootstrap --arch=arm64 bookworm into $ROOT (this takes a while)"
    rm -rf "$ROOT"
    mkdir -p "$ROOT"
    debootstrap --arch=arm64 --variant=minbase --include="$PACKAGES" bookworm "$ROOT" "$mirror"
    touch "$ROOT/.root-done"
}

mounted() { grep -q " $1 " /proc/mounts; }

enter() {
    mounted "$ROOT/proc" || mount -t proc proc "$ROOT/proc"
    mounted "$ROOT/dev" || mount --bind /dev "$ROOT/dev"
    trap leave EXIT INT TERM
}

leave() {
    for m in "$ROOT/dev" "$ROOT/proc"; do
        if mounted "$m"; then umount "$m" || umount -l "$m"; fi
    done
}

build_in_root() {
    say "build: copying the sources into the arm64 root"
    src="$ROOT/src"
    mkdir -p "$src"
    rm -rf "$src/blipmq_cli" "$src/blipmq_server" "$src/packaging" "$src/dist"
    cp -r blipmq_cli blipmq_server packaging pyproject.toml README.md "$src/"
    find "$src" -name __pycache__ -prune -exec rm -rf {} +
    # Trust what the host trusts (a TLS-intercepting proxy's CA, for pip).
    cp /etc/ssl/certs/ca-certificates.crt "$ROOT/etc/ssl/certs/host-ca.crt"
    enter
    cp /etc/resolv.conf "$ROOT/etc/resolv.conf"
    chroot "$ROOT" /usr/bin/env -i PATH=/usr/local/bin:/usr/bin:/bin HOME=/root LANG=C.UTF-8 \
        PIP_CERT=/etc/ssl/certs/host-ca.crt PIP_DISABLE_PIP_VERSION_CHECK=1 \
        PIP_DEFAULT_TIMEOUT=180 /bin/sh -c 'cd /src && python3 packaging/build.py'
    leave
    trap - EXIT INT TERM
    mkdir -p dist
    cp -p "$src"/dist/blipmq-*-linux-aarch64* dist/
    ls -l dist/*aarch64* >&2
}

smoke() {
    binary=$(ls -t dist/blipmq-*-linux-aarch64 2>/dev/null | head -n 1)
    [ -n "$binary" ] || die "no dist/blipmq-*-linux-aarch64: run '$0 build' first"
    [ -x .venv/bin/pytest ] || make .venv/.installed-dev
    say "smoke: $binary under qemu"
    QEMU_LD_PREFIX="$ROOT" BLIPMQ_DIST_BINARY="$TOP/$binary" \
        .venv/bin/pytest -q -p no:cacheprovider tests/test_dist_smoke.py
}

case "$STAGE" in
    root) need_tools; enable_binfmt; make_root ;;
    build) need_tools; enable_binfmt; make_root; build_in_root ;;
    smoke) need_tools; enable_binfmt; smoke ;;
    all) need_tools; enable_binfmt; make_root; build_in_root; smoke ;;
    *) die "usage: $0 [root|build|smoke|all]" ;;
esac
