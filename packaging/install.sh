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
# being prepared) and nothing is started; the unit is only enabled there, and files are
# owned by the ids of that root's user blipmq.
#
# What it installs:
#   /usr/local/lib/blipmq/blipmq-V-DIGEST  the onefile executable of version V (DIGEST: the
#                                      first 12 hex digits of its SHA-256), one file per version
#   /usr/local/lib/blipmq/blipmq       a symbolic link to the installed version's file: what the
#                                      unit and the wrapper run
#   /usr/local/bin/blipmq              a wrapper that unpacks it into RAM (blipmq-wrapper)
#   /etc/blipmq/blipmq.toml            `blipmq config init` output, root:blipmq 0640, written
#                                      once, never replaced (made 0640 if readable by all)
#   /etc/systemd/system/blipmq.service the unit, enabled; /var/lib/blipmq is its StateDirectory
#   user and group blipmq              system account, no login, no home
#
# Never replaced under a running process: a onefile executable reopens its own file (by its
# real path) for every module it imports late, so a file replaced or removed under it breaks
# it. An upgrade adds the new version's file and switches the link in one rename; it keeps the
# previous version's file and removes older ones unless a process still runs them (those are
# named and kept until a later run finds them unused). --uninstall removes every version's
# file that no process runs, names the processes running the others and keeps those files:
# stop them and run --uninstall again.
#
# One run at a time per root: each holds a lock on /usr/local/lib/blipmq/.lock (flock) from
# before it unpacks anything until it exits, and waits for it up to BLIPMQ_INSTALL_WAIT
# seconds (default 120). Under the lock it first removes what a run killed before it left
# there (.unpack.* directories, .*.new files). A stderr whose reader went away does not stop
# it half-way: it carries on without its messages.
#
# Exit codes: 0 done, 1 failed, 2 bad usage, 3 another install.sh on the same root held the
# lock for BLIPMQ_INSTALL_WAIT seconds (nothing was changed: run it again).
set -eu

HERE=$(cd "$(dirname "$0")" && pwd)
D=${DESTDIR:-}
LIB=/usr/local/lib/blipmq
UNIT=/etc/systemd/system/blipmq.service
WANTS=/etc/systemd/system/multi-user.target.wants/blipmq.service
unpack=""     # a directory that allows executing, where the executable unpacks while we run it
undo_to=""    # on a failure before anything was installed: remove "$D$LIB" up to this one
locked=""     # yes once this run holds the lock (fd 9 on $D$LIB/.lock)
busy=""       # yes when another run held the lock too long: exit 3
tmp=.new.$$   # the suffix of this run's temporary names in $D$LIB

# a write to a stderr whose reader went away must not end the run half-way (SIGPIPE ignored)
say() { echo "install.sh: $*" >&2 2>/dev/null || :; }
die() { say "$*"; exit 1; }
usage() { say "usage: $0 BINARY | $0 --uninstall [--purge]   (DESTDIR=... for another root)"; exit 2; }

finish() {
    rc=$1
    [ -z "$unpack" ] || rm -rf "$unpack"
    if [ -n "$locked" ]; then
        # the lock file goes with us: a run waiting on it sees it gone and takes a new one
        rm -f "$D$LIB/.lock" "$D$LIB/.blipmq$tmp"
        if [ -n "$undo_to" ]; then
            dir=$D$LIB
            while rmdir "$dir" 2>/dev/null && [ "$dir" != "$undo_to" ]; do
                dir=$(dirname "$dir")
            done
        fi
    fi
    [ -z "$busy" ] || exit 3
    if [ "$rc" -gt 2 ]; then  # a step above failed with its own code: ours is 1
        say "failed (a step exited with $rc)"
        exit 1
    fi
}
trap 'finish $?' EXIT
trap 'exit 1' HUP INT TERM
trap '' PIPE

if [ -n "$D" ]; then
    [ -d "$D" ] || die "DESTDIR $D is not a directory"
    D=$(cd "$D" && pwd)
    D=${D%/}
fi

live() { [ -z "$D" ] && [ -d /run/systemd/system ]; }

has_user() { grep -q '^blipmq:' "$D/etc/passwd" 2>/dev/null; }

# useradd/userdel in the target root
in_root() {
    cmd=$1
    shift
    if [ -n "$D" ]; then "$cmd" --root "$D" "$@"; else "$cmd" "$@"; fi
}

# numeric ids of the target root's user and group blipmq (not this machine's, with DESTDIR)
ids() {
    uid=$(awk -F: '$1 == "blipmq" { print $3; exit }' "$D/etc/passwd")
    gid=$(awk -F: '$1 == "blipmq" { print $3; exit }' "$D/etc/group")
    [ -n "$uid" ] && [ -n "$gid" ] || die "no user or group blipmq in $D/etc/passwd, $D/etc/group"
}

add_user() {
    has_user && return 0
    group=--user-group
    # a group blipmq left behind (by hand, or a removal cut short) is the user's group
    if grep -q '^blipmq:' "$D/etc/group" 2>/dev/null; then group="--gid=blipmq"; fi
    in_root useradd --system "$group" --no-create-home --home-dir /var/lib/blipmq \
        --shell /usr/sbin/nologin --comment "BlipMQ broker" blipmq
    say "created user blipmq"
}

# users_of FILE: the PIDs of the processes running FILE (their executable), on one line
users_of() {
    real=$(readlink -f -- "$1")
    pids=""
    for p in /proc/[0-9]*; do
        if [ "$(readlink "$p/exe" 2>/dev/null)" = "$real" ]; then
            pids="$pids ${p#/proc/}"
        fi
    done
    echo "${pids# }"
}

# remove FILE unless a process runs it; then name them and keep it
remove_unused() {
    pids=$(users_of "$1")
    if [ -n "$pids" ]; then
        say "kept ${1#"$D"}: still run by process(es) $pids; stop them and run install.sh again to remove it"
    else
        rm -f "$1"
    fi
}

# lock: hold $D$LIB/.lock (creating $D$LIB) for the rest of the run, so that two runs on
# one root never interleave (one's clean-up removing the other's new file, a link left
# pointing at nothing). Children inherit the descriptor: a killed run's executable still
# unpacking keeps the lock until it ends. Then remove what killed runs left behind.
lock() {
    command -v flock >/dev/null || die "flock not found (Debian package util-linux)"
    wait=${BLIPMQ_INSTALL_WAIT:-120}
    case $wait in "" | *[!0-9]*) die "BLIPMQ_INSTALL_WAIT=$wait: not a number of seconds" ;; esac
    while :; do
        undo_to=""
        dir=$D$LIB
        while [ ! -d "$dir" ]; do
            undo_to=$dir
            dir=$(dirname "$dir")
        done
        install -d -m 0755 "$D$LIB"
        exec 9>>"$D$LIB/.lock"
        if ! flock -w "$wait" 9; then
            busy=yes
            say "another install.sh is working on ${D:-/} (it holds $LIB/.lock) and did not finish within ${wait}s: nothing changed; run this again once it is done"
            exit 3
        fi
        # the run before us removes the lock file as it ends: hold the one now at that path
        if [ "$(stat -L -c %d:%i "$D$LIB/.lock" 2>/dev/null)" = "$(stat -L -c %d:%i "/proc/$$/fd/9")" ]; then
            break
        fi
        exec 9>&-
    done
    locked=yes
    # left by runs killed before us (each can be as large as the executable unpacked)
    rm -rf "$D$LIB"/.unpack.* "$D$LIB"/.blipmq.new "$D$LIB"/.blipmq.new.* "$D$LIB"/.blipmq-*.new \
        "$D$LIB"/.blipmq-*.new.*
}

# a directory under $D$LIB for the executable to unpack into while we run it: /tmp (its
# default) may be mounted noexec
make_unpack() {
    lock
    unpack=$(mktemp -d "$D$LIB/.unpack.XXXXXX")
}

# check_source FILE: a onefile blipmq executable that runs here; sets version
check_source() {
    binary=$1
    [ -f "$binary" ] || die "$binary: no such file"
    src=$(readlink -f -- "$binary")
    for installed in "$D$LIB/blipmq" "$D/usr/local/bin/blipmq"; do
        if [ -e "$installed" ] && [ "$src" = "$(readlink -f -- "$installed")" ]; then
            die "$binary is the installed ${installed#"$D"} itself: give the new executable (dist/blipmq-V-linux-ARCH)"
        fi
    done
    magic=$(head -c 4 "$src" | od -An -tx1 | tr -d ' \n')
    [ "$magic" = 7f454c46 ] \
        || die "$binary is not an executable (ELF) file: give the onefile executable dist/blipmq-V-linux-ARCH"
    [ "$(id -u)" -eq 0 ] || die "must run as root"
    make_unpack
    if ! out=$(TMPDIR=$unpack "$src" --version 2>&1); then
        first=$(printf '%s\n' "$out" | sed -n '/./{p;q;}')
        die "$binary does not run here: ${first:-no output} (its --version exited non-zero)"
    fi
    case $out in
        "blipmq "*" linux-"*) ;;
        *) die "$binary is not a blipmq executable (its --version says: $(printf '%s\n' "$out" | head -n 1))" ;;
    esac
    version=$(printf '%s\n' "$out" | awk 'NR == 1 { print $2 }')
    case $version in
        "" | *[!A-Za-z0-9._+-]*) die "$binary: unexpected version '$version' in its --version" ;;
    esac
}

# put_file SRC DEST MODE: DEST replaced in one rename (a process reading it keeps the old one);
# DEST.new is this run's alone, as it holds the lock
put_file() {
    install -m "$3" "$1" "$2.new"
    mv -f "$2.new" "$2"
}

install_executable() {
    digest=$(sha256sum < "$src" | cut -c 1-12)
    name=blipmq-$version-$digest
    if ! cmp -s "$src" "$D$LIB/$name" 2>/dev/null; then
        install -m 0755 "$src" "$D$LIB/.$name$tmp"
        mv -f "$D$LIB/.$name$tmp" "$D$LIB/$name"
    fi
    undo_to=""

    stable=$D$LIB/blipmq
    previous=""
    legacy=""
    if [ -L "$stable" ]; then
        previous=$(readlink "$stable")
    elif [ -f "$stable" ]; then
        # installed before versioned files: keep that file as the previous version
        legacy=$(users_of "$stable")
        previous=blipmq-old-$(sha256sum < "$stable" | cut -c 1-12)
        [ -e "$D$LIB/$previous" ] || ln "$stable" "$D$LIB/$previous"
    fi
    ln -sfn "$name" "$D$LIB/.blipmq$tmp"
    mv -Tf "$D$LIB/.blipmq$tmp" "$stable"
    say "installed $(printf '%s\n' "$out" | head -n 1) as $LIB/$name"
    if [ -n "$legacy" ]; then
        say "process(es) $legacy run the executable installed before versioned files, now replaced: restart them"
    fi

    # keep this version and the previous one; older ones go unless something still runs them.
    # Never the link's target, whatever it is by now.
    rm -f "$D$LIB/blipmq.new"
    [ "$previous" != "$name" ] || return 0
    current=$(readlink "$stable" || :)
    for file in "$D$LIB"/blipmq-*; do
        [ -f "$file" ] || continue
        case ${file##*/} in
            "$name" | "$previous" | "$current") ;;
            *) remove_unused "$file" ;;
        esac
    done
}

install_config() {
    conf=$D/etc/blipmq/blipmq.toml
    install -d -m 0755 "$D/etc/blipmq"
    if [ ! -e "$conf" ] && [ ! -L "$conf" ]; then
        # it may come to hold API keys or a bridge's password: root:blipmq 0640 from the start
        rm -f "$conf.new"
        if ! out=$(umask 077 && TMPDIR=$unpack "$D$LIB/blipmq" config init "$conf.new" 2>&1); then
            die "blipmq config init failed: $(printf '%s\n' "$out" | head -n 1)"
        fi
        chown "0:$gid" "$conf.new"
        chmod 0640 "$conf.new"
        mv -f "$conf.new" "$conf"
        say "wrote /etc/blipmq/blipmq.toml (root:blipmq 0640)"
    elif [ -n "$(find "$conf" -maxdepth 0 -perm /007)" ]; then
        chown "0:$gid" "$conf"
        chmod 0640 "$conf"
        say "kept /etc/blipmq/blipmq.toml, which other users could read: made it root:blipmq 0640"
    else
        say "kept /etc/blipmq/blipmq.toml"
    fi
}

enable_unit() {
    if live; then
        systemctl daemon-reload
        systemctl enable blipmq.service
        # a restart runs the new executable; the broker drains on SIGTERM
        systemctl restart blipmq.service
        say "blipmq.service enabled and (re)started: journalctl -u blipmq"
    else
        mkdir -p "$(dirname "$D$WANTS")"
        ln -sfn "$UNIT" "$D$WANTS"
        say "blipmq.service enabled under ${D:-/} (not started)"
    fi
}

install_all() {
    check_source "$1"
    install -d -m 0755 "$D/usr/local/bin"
    install_executable
    put_file "$HERE/blipmq-wrapper" "$D/usr/local/bin/blipmq" 0755

    add_user
    ids
    install_config
    install -d -m 0750 "$D/var/lib/blipmq"
    chown "$uid:$gid" "$D/var/lib/blipmq"

    install -d -m 0755 "$(dirname "$D$UNIT")"
    put_file "$HERE/blipmq.service" "$D$UNIT" 0644
    enable_unit
}

uninstall_all() {
    purge=$1
    [ "$(id -u)" -eq 0 ] || die "must run as root"
    lock  # also removes what killed runs left in $D$LIB
    if live; then
        systemctl disable --now blipmq.service 2>/dev/null || true
    fi
    rm -f "$D$WANTS" "$D$UNIT" "$D/usr/local/bin/blipmq" "$D$LIB/blipmq" "$D$LIB/blipmq.new"
    for file in "$D$LIB"/blipmq-*; do
        if [ -f "$file" ]; then
            remove_unused "$file"
        fi
    done
    # the lock file and the directory go once this run ends (finish), if nothing is kept
    [ -n "$undo_to" ] || undo_to=$D$LIB
    live && systemctl daemon-reload
    if [ "$purge" = yes ]; then
        rm -rf "$D/etc/blipmq" "$D/var/lib/blipmq"
        if has_user; then
            in_root userdel blipmq
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
