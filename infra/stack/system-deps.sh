#!/usr/bin/env bash
# Install the Debian packages the stack and its tests use, when missing:
#   system-deps.sh postgresql   (make up DB=postgres)     system-deps.sh chromium   (browser tests)
#   system-deps.sh libaio-dev   (DeepSpeed's async I/O op: ZeRO-Infinity NVMe offload; make system-deps)
# Quick no-op when they are there. Needs root (or sudo) and Debian's apt.
set -euo pipefail
missing=()
for pkg in "$@"; do
  case "$pkg" in
    postgresql) ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 || missing+=(postgresql) ;;
    chromium) command -v chromium >/dev/null 2>&1 || missing+=(chromium) ;;
    libaio-dev) [ -e /usr/include/libaio.h ] || missing+=(libaio-dev) ;;
    *) echo "system-deps.sh: unknown package $pkg" >&2; exit 2 ;;
  esac
done
[ ${#missing[@]} -eq 0 ] && exit 0
SUDO=""
[ "$(id -u)" -eq 0 ] || SUDO="sudo"
echo "[system-deps] installing ${missing[*]} from Debian's packages" >&2
$SUDO apt-get update -qq
DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
