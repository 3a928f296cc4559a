#!/usr/bin/env bash
# Installs the Debian packages gpumem's build needs, only those missing.
set -euo pipefail
packages=(cmake ninja-build g++ make libgtest-dev libgmock-dev zlib1g-dev pkg-config python3
          redis-server libhiredis-dev)
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "installing: ${missing[*]}"
  sudo_cmd=""
  [ "$(id -u)" -ne 0 ] && sudo_cmd="sudo"
  $sudo_cmd apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo_cmd apt-get install -y -qq "${missing[@]}"
fi
