"""What the docs-page generators share: write the page, or with --check say it is stale."""

import sys
from pathlib import Path


def write_or_check(page: Path, text: str, argv: list[str], wrote: str = "") -> int:
    """`text` into `page` (0), or with `--check` in `argv` 1 when `page` differs from it."""
    script = Path(sys.argv[0]).name if sys.argv and sys.argv[0].endswith(".py") else "its script"
    if "--check" in argv:
        if not page.is_file() or page.read_text(encoding="utf-8") != text:
            print(f"{page} is stale: run python scripts/{script}", file=sys.stderr)
            return 1
        return 0
    page.parent.mkdir(parents=True, exist_ok=True)
    page.write_text(text, encoding="utf-8")
    print(f"wrote {page}{wrote}")
    return 0
