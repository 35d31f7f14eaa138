#!/usr/bin/env bash
# Render the diagrams of the docs from their sources (docs/img/*.dot -> .svg and .png).
# Needs graphviz (`apt-get install graphviz`, or `brew install graphviz`).
set -euo pipefail
cd "$(dirname "$0")/.."
command -v dot >/dev/null || { echo "error: graphviz's dot is not installed (apt-get install graphviz)" >&2; exit 2; }
for src in docs/img/*.dot; do
  dot -Tsvg "$src" -o "${src%.dot}.svg"
  dot -Tpng -Gdpi=110 "$src" -o "${src%.dot}.png"
  echo "rendered ${src%.dot}.svg and .png"
done
