#!/usr/bin/env bash
# Re-vendor the chat page's browser libraries into flashdraft/server/static/vendor/.
#
# The page must work offline and under a strict CSP, so the libraries are checked into git
# rather than loaded from a CDN; CI has no npm step. This script is the only way those files
# change: it packs the pinned versions from the npm registry, copies the few files the page
# uses plus each package's licence, and writes VENDOR.json (package, version, source path,
# licence, sha256 per file), which tests/test_webui.py checks the tree against. To upgrade,
# edit the versions below, run the script, and review the diff. Needs npm, node and tar.
#   scripts/vendor_webui.sh
set -euo pipefail

# package@version | file in the package | name in vendor/
FILES=(
  "marked@18.2.1|lib/marked.umd.js|marked.umd.js"
  "marked@18.2.1|LICENSE|marked.LICENSE"
  "dompurify@3.5.0|dist/purify.min.js|purify.min.js"
  "dompurify@3.5.0|LICENSE|dompurify.LICENSE"
  "@highlightjs/cdn-assets@11.12.0|highlight.min.js|highlight.min.js"
  "@highlightjs/cdn-assets@11.12.0|styles/github.min.css|github.min.css"
  "@highlightjs/cdn-assets@11.12.0|LICENSE|highlightjs.LICENSE"
)

root=$(cd "$(dirname "$0")/.." && pwd)
dest="$root/flashdraft/server/static/vendor"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

# one pack per package: npm checks each tarball against the registry's integrity hash
declare -A unpacked=()
for entry in "${FILES[@]}"; do
  spec=${entry%%|*}
  [[ -n ${unpacked[$spec]:-} ]] && continue
  dir="$tmp/$(printf '%s' "$spec" | tr '@/' '__')"
  mkdir -p "$dir"
  tarball=$(cd "$tmp" && npm pack --silent "$spec" | tail -n 1)
  tar -xzf "$tmp/$tarball" -C "$dir"
  unpacked[$spec]="$dir/package"
done

# replace vendor/ wholly, so a file dropped from the list does not linger
rm -rf "$dest"
mkdir -p "$dest"
manifest="$tmp/manifest.tsv"
: > "$manifest"
for entry in "${FILES[@]}"; do
  IFS='|' read -r spec source name <<< "$entry"
  cp "${unpacked[$spec]}/$source" "$dest/$name"
  sha=$(sha256sum "$dest/$name" | cut -d' ' -f1)
  license=$(node -p 'require(process.argv[1]).license' "${unpacked[$spec]}/package.json")
  printf '%s\t%s\t%s\t%s\t%s\t%s\n' "$name" "${spec%@*}" "${spec##*@}" "$source" "$license" "$sha" >> "$manifest"
done

node - "$manifest" "$dest/VENDOR.json" <<'EOF'
const fs = require("fs");
const [manifest, out] = process.argv.slice(2);
const files = {};
for (const line of fs.readFileSync(manifest, "utf8").trim().split("\n")) {
  const [name, pkg, version, source, license, sha256] = line.split("\t");
  files[name] = { package: pkg, version, source, license, sha256 };
}
const doc = {
  comment: "Regenerate with scripts/vendor_webui.sh, never by hand; tests/test_webui.py checks the files against it.",
  files,
};
fs.writeFileSync(out, JSON.stringify(doc, null, 2) + "\n");
EOF
ls -l "$dest"
