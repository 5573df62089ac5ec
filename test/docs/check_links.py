#!/usr/bin/env python3
"""Checks the relative links of the docs: every `](path)` and `](path#anchor)` in docs/*.md,
docs/*/*.md, README.md and NEWS.md must name a file that exists, and an anchor must name a
heading of that file (GitHub's form: lower case, punctuation dropped, spaces as hyphens, -1, -2
for repeats). Links to http(s) and mailto are not followed; fenced blocks and inline code are
skipped. Prints one line per broken link and exits 1 if there is any.

Usage: check_links.py SOURCE_DIR
"""
import glob
import os
import re
import sys


def strip_code(text):
    """The text with fenced blocks and inline code spans blanked (line numbers kept)."""
    out = []
    inside = False
    for line in text.split("\n"):
        if line.lstrip().startswith("```"):
            inside = not inside
            out.append("")
            continue
        out.append("" if inside else re.sub(r"`[^`]*`", "", line))
    return out


def anchors(path):
    seen = {}
    result = set()
    inside = False
    with open(path, encoding="utf-8") as f:
        for line in f:
            if line.lstrip().startswith("```"):
                inside = not inside
                continue
            m = None if inside else re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
            if not m:
                continue
            slug = re.sub(r"[^\w\- ]", "", m.group(1).lower()).replace(" ", "-")
            n = seen.get(slug, 0)
            seen[slug] = n + 1
            result.add(slug if n == 0 else "%s-%d" % (slug, n))
    return result


def main():
    src = os.path.abspath(sys.argv[1])
    files = sorted(glob.glob(os.path.join(src, "docs", "*.md")) + glob.glob(os.path.join(src, "docs", "*", "*.md")) +
                   [os.path.join(src, "README.md"), os.path.join(src, "NEWS.md")])
    broken = 0
    checked = 0
    cache = {}
    for doc in files:
        with open(doc, encoding="utf-8") as f:
            lines = strip_code(f.read())
        for number, line in enumerate(lines, 1):
            for m in re.finditer(r"\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)", line):
                target = m.group(1)
                if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
                    continue
                path, _, anchor = target.partition("#")
                full = os.path.normpath(os.path.join(os.path.dirname(doc), path)) if path else doc
                where = "%s:%d: %s" % (os.path.relpath(doc, src), number, target)
                checked += 1
                if not os.path.exists(full):
                    print("broken link: %s (no file %s)" % (where, os.path.relpath(full, src)))
                    broken += 1
                    continue
                if anchor:
                    if not full.endswith(".md"):
                        continue
                    if full not in cache:
                        cache[full] = anchors(full)
                    if anchor not in cache[full]:
                        print("broken link: %s (no heading #%s in %s)" % (where, anchor, os.path.relpath(full, src)))
                        broken += 1
    print("%d relative links checked in %d files, %d broken" % (checked, len(files), broken))
    return 1 if broken else 0


if __name__ == "__main__":
    sys.exit(main())
