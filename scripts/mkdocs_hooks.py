"""MkDocs hooks for the docs site (mkdocs.yml `hooks:`).

A table cell that shows a pipe in code is written `` `a\\|b` ``: GitHub needs the backslash
there (it splits cells on every unescaped pipe), while Python-Markdown keeps pipes inside code
spans and would print it. The site drops the backslash, so both render `a|b`.
"""

import re

_CODE_SPAN = re.compile(r"`[^`\n]*`")


def on_page_markdown(markdown: str, **kwargs) -> str:
    lines = []
    for line in markdown.split("\n"):
        if line.lstrip().startswith("|"):
            line = _CODE_SPAN.sub(lambda m: m.group(0).replace("\\|", "|"), line)
        lines.append(line)
    return "\n".join(lines)
