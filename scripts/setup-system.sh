#!/usr/bin/env bash
# Debian packages the sandbox, tools, proxy and CPU kernels need. Idempotent; needs root (or sudo).
set -euo pipefail
pkgs=(bubblewrap ripgrep iproute2 iptables curl git g++ ninja-build)
missing=()
for p in "${pkgs[@]}"; do dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p"); done
[ ${#missing[@]} -eq 0 ] && exit 0
sudo=""; [ "$(id -u)" -eq 0 ] || sudo="sudo"
$sudo apt-get update -q
DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -q "${missing[@]}"
