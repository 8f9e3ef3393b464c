#!/usr/bin/env bash
# System packages the test suite needs beyond Python: redis-server (Index Service on Redis),
# iproute2 and util-linux (private network namespaces for the interop peer and the
# deployment tests), curl and jq (README's worked example, which a test runs as written), nftables
# (packet loss on the links of a fleet on one machine: this kernel has no netem).
set -euo pipefail
missing=()
command -v redis-server >/dev/null 2>&1 || missing+=(redis-server)
command -v ip >/dev/null 2>&1 || missing+=(iproute2)
command -v unshare >/dev/null 2>&1 || missing+=(util-linux)
command -v curl >/dev/null 2>&1 || missing+=(curl)
command -v jq >/dev/null 2>&1 || missing+=(jq)
command -v nft >/dev/null 2>&1 || missing+=(nftables)
[ ${#missing[@]} -eq 0 ] && exit 0
if [ "$(id -u)" -ne 0 ]; then
  echo "system-deps: please install: ${missing[*]} (needs root)" >&2
  exit 1
fi
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
