#!/usr/bin/env bash
# Installs the independent MOQT peer (aiomoqt, pinned with hashes) into interop/.venv-aiomoqt.
# aiomoqt needs Python 3.12: pyenv's 3.12 when present, else python3.12 on PATH.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
venv="$here/.venv-aiomoqt"
if [ -x "$venv/bin/moq-interop-client" ] && [ -x "$venv/bin/moq-interop-relay" ]; then
  exit 0
fi
py=""
if command -v pyenv >/dev/null 2>&1; then
  for v in $(pyenv versions --bare 2>/dev/null | grep -E '^3\.12(\.|$)' | sort -V -r); do
    cand="$(pyenv root)/versions/$v/bin/python"
    [ -x "$cand" ] && py="$cand" && break
  done
fi
[ -z "$py" ] && py="$(command -v python3.12 || true)"
if [ -z "$py" ]; then
  echo "interop: no Python 3.12 interpreter found (pyenv 3.12 or python3.12 on PATH); aiomoqt needs it" >&2
  exit 1
fi
rm -rf "$venv"
"$py" -m venv "$venv"
"$venv/bin/python" -m pip install -q --require-hashes --only-binary=:all: \
  -r "$here/aiomoqt-requirements.txt"
"$venv/bin/moq-interop-client" --help >/dev/null
echo "interop: aiomoqt installed in $venv"
