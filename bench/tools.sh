#!/usr/bin/env bash
# Installs the benchmark's system tools when missing: nginx (reference proxy and fast origin)
# and wrk (HTTP load generator), from Debian's packages. Never fails: a tool that cannot be
# installed makes its columns or workloads "absent" (with the reason) in the results.
set -u
missing=()
command -v nginx >/dev/null 2>&1 || missing+=(nginx)
command -v wrk >/dev/null 2>&1 || missing+=(wrk)
command -v strace >/dev/null 2>&1 || missing+=(strace)
if [ ${#missing[@]} -eq 0 ]; then
    exit 0
fi
if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null 2>&1; then
    echo "bench: ${missing[*]} missing and cannot be installed here (needs root and apt-get)" >&2
    exit 0
fi
echo "bench: installing ${missing[*]} with apt-get"
export DEBIAN_FRONTEND=noninteractive
# nginx's package would start a system nginx on port 80; keep it from starting when the
# machine has no policy-rc.d of its own (containers usually have one that says 101).
created_policy=0
if [ ! -e /usr/sbin/policy-rc.d ]; then
    printf '#!/bin/sh\nexit 101\n' > /usr/sbin/policy-rc.d
    chmod +x /usr/sbin/policy-rc.d
    created_policy=1
fi
apt-get update -qq >/dev/null 2>&1 || echo "bench: apt-get update failed" >&2
apt-get install -y -qq "${missing[@]}" >/dev/null 2>&1 \
    || echo "bench: apt-get install ${missing[*]} failed; those columns will be absent" >&2
if [ "$created_policy" = 1 ]; then
    rm -f /usr/sbin/policy-rc.d
fi
exit 0
