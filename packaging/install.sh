#!/bin/sh
# Install the blipmq executable as a systemd service, or remove it. Idempotent: running it
# again upgrades the executable and the unit, and keeps the configuration and the data.
#
#   packaging/install.sh BINARY              install (or upgrade) and start the service
#   packaging/install.sh --uninstall         stop and remove the service and the executable;
#                                            keep /etc/blipmq, /var/lib/blipmq and the user
#   packaging/install.sh --uninstall --purge remove those too
#
# With DESTDIR=/some/root everything goes under that directory (a throwaway root, an image
# being prepared) and nothing is started; the unit is only enabled there.
#
# What it installs:
#   /usr/local/lib/blipmq/blipmq       the onefile executable
#   /usr/local/bin/blipmq              a wrapper that unpacks it into RAM (blipmq-wrapper)
#   /etc/blipmq/blipmq.toml            `blipmq config init` output, written once, never replaced
#   /etc/systemd/system/blipmq.service the unit, enabled; /var/lib/blipmq is its StateDirectory
#   user and group blipmq              system account, no login, no home
# Exit codes: 0 done, 1 failed, 2 bad usage.
set -eu

HERE=$(cd "$(dirname "$0")" && pwd)
D=${DESTDIR:-}
D=${D%/}
LIB=/usr/local/lib/blipmq
UNIT=/etc/systemd/system/blipmq.service
WANTS=/etc/systemd/system/multi-user.target.wants/blipmq.service

say() { echo "install.sh: $*" >&2; }
die() { say "$*"; exit 1; }
usage() { say "usage: $0 BINARY | $0 --uninstall [--purge]   (DESTDIR=... for another root)"; exit 2; }

live() { [ -z "$D" ] && [ -d /run/systemd/system ]; }

has_user() { grep -q '^blipmq:' "$D/etc/passwd" 2>/dev/null; }

add_user() {
    has_user && return 0
    root=""
    [ -n "$D" ] && root="--root $D"
    # shellcheck disable=SC2086
    useradd $root --system --user-group --no-create-home --home-dir /var/lib/blipmq \
        --shell /usr/sbin/nologin --comment "BlipMQ broker" blipmq
    say "created user blipmq"
}

enable_unit() {
    if live; then
        systemctl daemon-reload
        systemctl enable blipmq.service
        # a restart picks up a replaced executable; the broker drains on SIGTERM
        systemctl restart blipmq.service
        say "blipmq.service enabled and (re)started: journalctl -u blipmq"
    else
        mkdir -p "$(dirname "$D$WANTS")"
        ln -sfn "$UNIT" "$D$WANTS"
        say "blipmq.service enabled under ${D:-/} (not started)"
    fi
}

install_all() {
    binary=$1
    [ -f "$binary" ] || die "$binary: no such file"
    "$binary" --version >/dev/null 2>&1 || die "$binary does not run here (see '$binary --version')"
    [ "$(id -u)" -eq 0 ] || die "must run as root"

    # the new executable goes in under a temporary name and replaces the old one in one
    # rename: a running broker keeps its (unlinked) file until it restarts
    install -d -m 0755 "$D$LIB" "$D/usr/local/bin"
    install -m 0755 "$binary" "$D$LIB/blipmq.new"
    mv -f "$D$LIB/blipmq.new" "$D$LIB/blipmq"
    install -m 0755 "$HERE/blipmq-wrapper" "$D/usr/local/bin/blipmq"
    say "installed $("$D$LIB/blipmq" --version)"

    add_user
    install -d -m 0755 "$D/etc/blipmq"
    install -d -m 0750 "$D/var/lib/blipmq"
    chown blipmq:blipmq "$D/var/lib/blipmq" 2>/dev/null \
        || chown "$(awk -F: '$1 == "blipmq" { print $3 ":" $4 }' "$D/etc/passwd")" "$D/var/lib/blipmq"
    if [ ! -e "$D/etc/blipmq/blipmq.toml" ]; then
        "$D$LIB/blipmq" config init "$D/etc/blipmq/blipmq.toml"
        chmod 0644 "$D/etc/blipmq/blipmq.toml"
    else
        say "kept $D/etc/blipmq/blipmq.toml"
    fi

    install -d -m 0755 "$(dirname "$D$UNIT")"
    install -m 0644 "$HERE/blipmq.service" "$D$UNIT"
    enable_unit
}

uninstall_all() {
    purge=$1
    [ "$(id -u)" -eq 0 ] || die "must run as root"
    if live; then
        systemctl disable --now blipmq.service 2>/dev/null || true
    fi
    rm -f "$D$WANTS" "$D$UNIT" "$D/usr/local/bin/blipmq" "$D$LIB/blipmq" "$D$LIB/blipmq.new"
    rmdir "$D$LIB" 2>/dev/null || true
    live && systemctl daemon-reload
    if [ "$purge" = yes ]; then
        rm -rf "$D/etc/blipmq" "$D/var/lib/blipmq"
        if has_user; then
            root=""
            [ -n "$D" ] && root="--root $D"
            # shellcheck disable=SC2086
            userdel $root blipmq
        fi
        say "removed blipmq, its configuration, its data and its user"
    else
        say "removed blipmq; kept /etc/blipmq, /var/lib/blipmq and user blipmq (--purge removes them)"
    fi
}

[ $# -ge 1 ] || usage
case "$1" in
    --uninstall)
        case "${2:-}" in
            "") uninstall_all no ;;
            --purge) uninstall_all yes ;;
            *) usage ;;
        esac ;;
    -*) usage ;;
    *) [ $# -eq 1 ] || usage; install_all "$1" ;;
esac
