#!/usr/bin/env bash
# Create .venv and install mlx-server into it with the extras named in $1 (comma-separated:
# "" for serving, "test,vision,embeddings" for the tests). Idempotent: a stamp in .venv
# records pyproject.toml's hash and the extras installed, and an install that would change
# nothing is skipped.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
want=${1:-}
stamp=.venv/.mlx-server-install
hash=$(cksum pyproject.toml | cut -d' ' -f1)

if [ ! -x .venv/bin/python ]; then
  echo "[setup] creating .venv with $("$PY" --version 2>&1)"
  "$PY" -m venv .venv
fi

# The extras an earlier run installed, and whether $want is among them.
have=""
[ -f "$stamp" ] && have=$(sed -n 2p "$stamp")
missing=""
for extra in ${want//,/ }; do
  case ",$have," in *",$extra,"*) ;; *) missing="$missing $extra" ;; esac
done
if [ -f "$stamp" ] && [ "$(sed -n 1p "$stamp")" = "$hash" ] && [ -z "$missing" ]; then
  echo "[setup] mlx-server is installed in .venv (extras: ${have:-none}); nothing to install"
  exit 0
fi

# Install the earlier extras again too: a changed pyproject.toml may have changed them.
all=$(printf '%s\n' ${have//,/ } ${want//,/ } | sort -u | paste -sd, -)
target="."
[ -n "$all" ] && target=".[$all]"
echo "[setup] installing mlx-server ($target) into .venv; pip shows its progress"
.venv/bin/python -m pip install -q --upgrade pip >/dev/null 2>&1 || true
.venv/bin/python -m pip install --progress-bar on -e "$target"
printf '%s\n%s\n' "$hash" "$all" >"$stamp"
echo "[setup] done"
