#!/usr/bin/env bash
# Writes the King James Bible (Debian's bible-kjv) as a word-level corpus in the WikiText format:
# one verse per line, punctuation split off as separate tokens.
#   scripts/prepare-kjv.sh OUT_FILE
set -euo pipefail
out=${1:?usage: prepare-kjv.sh OUT_FILE}
command -v bible >/dev/null || { echo "prepare-kjv: 'bible' not found (apt-get install bible-kjv bible-kjv-text)" >&2; exit 1; }
mkdir -p "$(dirname "$out")"
bible -p /usr/lib "Gen1:1-Rev22:21" |
  awk '
    /^[A-Za-z0-9 ]+ [0-9]+$/ && !/^  / { next }          # chapter headings ("Genesis 1")
    /^  *[0-9]+ / { if (verse != "") print verse; sub(/^ *[0-9]+ /, ""); verse = $0; next }
    NF { verse = verse " " $0 }
    END { if (verse != "") print verse }' |
  sed -e 's/\([.,;:!?()]\)/ \1 /g' -e "s/'s\b/ 's/g" -e 's/  */ /g' -e 's/^ //' -e 's/ $//' > "$out.tmp"
mv "$out.tmp" "$out"
echo "prepare-kjv: $(wc -l < "$out") verses, $(wc -w < "$out") tokens -> $out" >&2
