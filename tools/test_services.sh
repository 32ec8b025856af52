#!/usr/bin/env bash
# The system packages the test suite runs for real (`make test` calls this before pytest): installs
# the missing ones with apt-get when run as root; otherwise says, one line each, what it could not
# install and which tests fail without it, and goes on. Does nothing (no apt-get update) when all
# are present.
set -uo pipefail

# Looks in the sbin folders and PostgreSQL's versioned folder too: a non-root PATH often lacks
# /usr/sbin, and Debian's postgresql keeps initdb and pg_ctl off PATH.
has() {
    local name folder
    for name in "$@"; do
        command -v "$name" >/dev/null 2>&1 && continue
        for folder in /usr/sbin /usr/local/sbin /sbin /usr/lib/postgresql/*/bin; do
            [ -x "$folder/$name" ] && continue 2
        done
        return 1
    done
}

# package | commands that must all exist (any one of each `a/b` pair) | tests that fail without it
PACKAGES=(
    "mariadb-server|mariadbd/mysqld mariadb-install-db/mysql_install_db|the MySQL alert-delivery tests (test_alerts_outages, test_alerts_secrets, test_lost_commit)"
    "postgresql|initdb pg_ctl postgres|the PostgreSQL alert-delivery tests (test_alerts, test_alerts_demo, test_alerts_outages, test_alerts_storm, test_alerts_secrets, test_lost_commit)"
    "openssl|openssl|the SMTP alert tests, whose server's certificate it makes (test_alerts, test_alerts_outages, test_alerts_storm, test_alerts_secrets, test_alerts_email_resend, test_alerts_demo)"
    "prometheus|prometheus|test_trackers_prometheus (a real Prometheus server scraping the run's endpoint)"
    "util-linux|unshare nsenter runuser|test_read_only_folder (unshare, nsenter) and, under root, every database test (runuser)"
)

present() {
    local alternatives
    for alternatives in $1; do
        local found=no name
        for name in ${alternatives//\// }; do
            has "$name" && found=yes && break
        done
        [ "$found" = yes ] || return 1
    done
}

missing=()
declare -A commands_of needed_by
for entry in "${PACKAGES[@]}"; do
    IFS='|' read -r package commands tests <<<"$entry"
    commands_of[$package]=$commands
    needed_by[$package]=$tests
    present "$commands" || missing+=("$package")
done

if [ ${#missing[@]} -eq 0 ]; then
    echo "test services: ${PACKAGES[*]%%|*} present, nothing to install"
    exit 0
fi

if [ "$(id -u)" -ne 0 ] || ! command -v apt-get >/dev/null 2>&1; then
    why=$([ "$(id -u)" -ne 0 ] && echo "not root" || echo "no apt-get")
    for package in "${missing[@]}"; do
        echo "test services: cannot install $package ($why): ${needed_by[$package]} will fail"
    done
    exit 0
fi

echo "test services: installing ${missing[*]}"
# policy-rc.d 101 keeps the packages' own system-wide servers from starting: the tests start
# throwaway ones on free ports.
policy=/usr/sbin/policy-rc.d
own_policy=no
if [ ! -e "$policy" ]; then
    printf '#!/bin/sh\nexit 101\n' >"$policy" && chmod +x "$policy" && own_policy=yes
fi
if apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${missing[@]}"; then
    status=0
else
    status=1
fi
[ "$own_policy" = yes ] && rm -f "$policy"
if [ $status -ne 0 ]; then
    for package in "${missing[@]}"; do
        present "${commands_of[$package]}" ||
            echo "test services: apt-get could not install $package: ${needed_by[$package]} will fail"
    done
fi
exit 0
