#!/usr/bin/env bash
# Installs the second independent MOQT peer, moq-rs (the Python package of the Rust moq-dev
# stack, pinned with hashes), into interop/.venv-moqrs. It is built for Python 3.11: pyenv's
# 3.11 when present, else python3.11 on PATH.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
venv="$here/.venv-moqrs"
if [ -x "$venv/bin/python" ] && "$venv/bin/python" -c 'import moq, moq_ffi' >/dev/null 2>&1; then
  exit 0
fi
py=""
if command -v pyenv >/dev/null 2>&1; then
  for v in $(pyenv versions --bare 2>/dev/null | grep -E '^3\.11(\.|$)' | sort -V -r); do
    cand="$(pyenv root)/versions/$v/bin/python"
    [ -x "$cand" ] && py="$cand" && break
  done
fi
[ -z "$py" ] && py="$(command -v python3.11 || true)"
if [ -z "$py" ]; then
  echo "interop: no Python 3.11 interpreter found (pyenv 3.11 or python3.11 on PATH); moq-rs needs it" >&2
  exit 1
fi
rm -rf "$venv"
"$py" -m venv "$venv"
if ! "$venv/bin/python" -m pip install -q --require-hashes --only-binary=:all: \
    -r "$here/moqrs-requirements.txt"; then
  echo "interop: installing moq-rs from interop/moqrs-requirements.txt failed (network access needed)" >&2
  exit 1
fi
if ! "$venv/bin/python" -c 'import moq, moq_ffi' >/dev/null 2>&1; then
  echo "interop: moq-rs installed in $venv but 'import moq' fails" >&2
  exit 1
fi
echo "interop: moq-rs installed in $venv"
