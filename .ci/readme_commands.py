"""Print README.md's two commands (the first two ```bash blocks of "## Two commands on a fresh
machine"), one a line: what .ci/run runs, so that CI runs what a new user copies. Exits 1, naming
the section, when they are not two one-line commands."""

import re
import sys
from pathlib import Path

README = Path(__file__).resolve().parent.parent / "README.md"
SECTION = "## Two commands on a fresh machine"

text = README.read_text()
if SECTION not in text:
    sys.exit(f"README.md has no section {SECTION!r}: .ci/run reads the two commands from it")
section = text.split(SECTION, 1)[1].split("\n## ", 1)[0]
blocks = [b.strip() for b in re.findall(r"```bash\n(.*?)```", section, re.S)][:2]
if len(blocks) != 2 or any("\n" in b for b in blocks):
    sys.exit(
        f"README.md's {SECTION!r} must open with two ```bash blocks of one command each; found {blocks}"
    )
print("\n".join(blocks))
