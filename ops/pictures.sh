#!/usr/bin/env bash
# Renders the pictures of the system (docs/pictures/*.dot, Graphviz sources) to SVG and PNG beside each source:
# the architecture (a request's path) and the deployment. Needs Graphviz's dot (Debian: apt-get install graphviz);
# the rendered files are committed, so reading the docs needs nothing. Usage: bash ops/pictures.sh
set -euo pipefail
cd "$(dirname "$0")/../docs/pictures"
command -v dot >/dev/null || { echo "pictures: no dot on PATH (Debian: apt-get install graphviz)" >&2; exit 2; }
for source in *.dot; do
  name=${source%.dot}
  dot -Tsvg "$source" -o "$name.svg"
  dot -Tpng -Gdpi=96 "$source" -o "$name.png"
  echo "pictures: docs/pictures/$name.svg and .png from $source" >&2
done
