#!/usr/bin/env bash
# Writes train/data/corpus.txt: public-domain English from two Debian packages, one paragraph
# a line, documents in a fixed order.
#   bible-kjv + bible-kjv-text: the King James Version (1611; public domain), a chapter a line.
#   r-cran-janeaustenr: Jane Austen's six completed novels (public domain), a paragraph a line.
# Install them with `apt-get install bible-kjv bible-kjv-text r-cran-janeaustenr` (the last pulls
# in R, whose Rscript reads the package's data). Nothing is downloaded from anywhere else.
set -euo pipefail
cd "$(dirname "$0")"
mkdir -p data
for tool in bible Rscript; do
  command -v "$tool" >/dev/null || { echo "corpus.sh: $tool not found: apt-get install bible-kjv bible-kjv-text r-cran-janeaustenr" >&2; exit 1; }
done
out=data/corpus.txt
tmp=$out.partial
: >"$tmp"
# Austen: lines of the R data frame; an empty line ends a paragraph. Runs of spaces become one
# and the underscores that mark italics go.
Rscript -e '
  suppressMessages(library(janeaustenr))
  b <- austen_books()
  para <- character(0)
  flush <- function() { if (length(para) > 0) cat(paste(para, collapse = " "), "\n", sep = ""); para <<- character(0) }
  for (i in seq_len(nrow(b))) {
    t <- gsub("_", "", gsub(" {2,}", " ", trimws(b$text[i])))
    if (nchar(t) == 0) flush() else para <- c(para, t)
  }
  flush()
' >>"$tmp"
# KJV: "Ge1:1 text" lines; a chapter becomes one line of its verses.
bible -f "Gen1:1-Rev22:21" | awk '
  { ref = $1; sub(/^[^ ]+ /, ""); split(ref, a, ":"); ch = a[1]
    if (ch != last && line != "") { print line; line = "" }
    line = (line == "" ? $0 : line " " $0); last = ch }
  END { if (line != "") print line }' >>"$tmp"
mv "$tmp" "$out"
echo "corpus.sh: wrote $out: $(wc -l <"$out") paragraphs, $(wc -c <"$out") bytes" >&2
