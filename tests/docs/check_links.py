# SPDX-License-Identifier: Apache-2.0
"""Check the relative links of the project's markdown files.

Every link [text](target), image ![alt](target) and reference definition `[ref]: target` in
README.md and docs/*.md (outside code blocks and code spans) whose target is relative:
- its path (relative to the linking file; a leading / is the checkout root) names a file or
  directory of the source tree, and does not climb out of it;
- its #anchor, where the target is a markdown file (or the link is `#anchor` alone), is a
  heading of that file as GitHub names it: the heading's text, lowercased, with every character
  that is not a letter, digit, space, - or _ dropped and each space made a -; the second heading
  of the same name gets -1, the third -2, and so on. An explicit <a name="x"> or id="x" counts
  too.
Links with a scheme (https:, mailto:, ...) are not followed: the test needs no network.

Usage: check_links.py SRC [FILE.md ...]   (default: SRC/README.md and SRC/docs/*.md)
Exit status 0 when every link resolves, 1 otherwise (each bad link named with file:line).
"""
import glob
import os
import re
import sys
import unicodedata
from urllib.parse import unquote

FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})")
HEADING = re.compile(r"^ {0,3}(#{1,6})\s+(.*?)(?:\s+#+)?\s*$")
SETEXT = re.compile(r"^ {0,3}(=+|-+)\s*$")
# [text](target "title") and ![alt](target); the text may hold one level of brackets
INLINE = re.compile(r"!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]"
                    r"\(\s*(<[^>]*>|[^\s()]*(?:\([^\s()]*\)[^\s()]*)*)"
                    r"(?:\s+(?:\"[^\"]*\"|'[^']*'|\([^)]*\)))?\s*\)")
REFDEF = re.compile(r"^ {0,3}\[[^\]]+\]:\s*(<[^>]*>|\S+)")
CODE_SPAN = re.compile(r"(`+)(?:(?!\1).)+?\1")
HTML_ANCHOR = re.compile(r"<[^>]*\b(?:name|id)\s*=\s*[\"']([^\"']+)[\"']", re.I)
SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*:")


def slug(text):
    """GitHub's anchor for a heading's text."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", text)  # links and images: their text
    text = re.sub(r"<[^>]+>", "", text)  # inline HTML
    out = []
    for ch in text.lower():
        cat = unicodedata.category(ch)
        if ch in "-_" or cat[0] in "LN" or cat == "Mn":
            out.append(ch)
        elif ch == " ":
            out.append("-")
    return "".join(out)


def scan(path):
    """(anchors, links): the file's anchors, and its links as (line, target)."""
    with open(path, encoding="utf-8") as f:
        lines = f.read().split("\n")
    anchors, seen, links = set(), {}, []
    fence = None
    prev = ""
    for n, line in enumerate(lines, 1):
        m = FENCE.match(line)
        if fence:
            if m and m.group(1)[0] == fence[0] and len(m.group(1)) >= len(fence) \
                    and not line.strip().strip(fence[0]):
                fence = None
            prev = ""
            continue
        if m:
            fence = m.group(1)
            prev = ""
            continue
        if line.startswith("    ") and not prev.strip():
            prev = ""  # an indented code block's line (after a blank line)
            continue
        text = None
        h = HEADING.match(line)
        if h:
            text = h.group(2)
        elif SETEXT.match(line) and prev.strip() and not HEADING.match(prev) \
                and not prev.lstrip().startswith(("|", "-", "*", ">")):
            text = prev.strip()
        if text is not None:
            s = slug(text)
            k = seen.get(s, 0)
            seen[s] = k + 1
            anchors.add(s if k == 0 else f"{s}-{k}")
        anchors.update(a for a in HTML_ANCHOR.findall(line))
        plain = CODE_SPAN.sub("", line)
        for m in INLINE.finditer(plain):
            links.append((n, m.group(1)))
        r = REFDEF.match(plain)
        if r:
            links.append((n, r.group(1)))
        prev = line
    return anchors, links


def main(argv):
    if not argv:
        print(__doc__, file=sys.stderr)
        return 2
    src = os.path.realpath(argv[0])
    files = argv[1:] or ([os.path.join(src, "README.md")]
                         + sorted(glob.glob(os.path.join(src, "docs", "*.md"))))
    cache = {}

    def anchors_of(path):
        if path not in cache:
            cache[path] = scan(path)[0]
        return cache[path]

    bad = checked = 0
    for md in files:
        md = os.path.realpath(md)
        shown = os.path.relpath(md, src)
        _, links = scan(md)
        for n, target in links:
            target = target.strip("<>")
            if not target or SCHEME.match(target):
                continue
            checked += 1
            path, _, anchor = target.partition("#")
            path = unquote(path)
            if not path:
                dest = md
            elif path.startswith("/"):
                dest = os.path.realpath(os.path.join(src, path.lstrip("/")))
            else:
                dest = os.path.realpath(os.path.join(os.path.dirname(md), path))
            problem = None
            if os.path.commonpath([dest, src]) != src:
                problem = "points outside the source tree"
            elif not os.path.exists(dest):
                problem = f"{os.path.relpath(dest, src)} does not exist"
            elif anchor and dest.endswith(".md") and os.path.isfile(dest):
                if unquote(anchor) not in anchors_of(dest):
                    problem = (f"no heading of {os.path.relpath(dest, src)} has the anchor "
                               f"#{anchor}")
            if problem:
                bad += 1
                print(f"links: {shown}:{n}: ({target}) {problem}", file=sys.stderr)
    print(f"links: {checked - bad} of {checked} relative links resolve in {len(files)} file(s)")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
