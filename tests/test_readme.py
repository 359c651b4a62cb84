"""The README says what the project does: its first commands, and the warnings it lists."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def test_readme_begins_with_the_demo_and_test_commands():
    first_block = README.split("```")[1]
    assert first_block.split() == ["bash", "make", "demo", "make", "test"]


def test_every_warning_listed_is_one_the_library_prints():
    section = README.split("## Warnings you may see")[1].split("\n## ")[0]
    listed = re.findall(r"^\| `(cswap: [^`]+)`", section, flags=re.MULTILINE)
    assert len(listed) >= 6
    source = "".join(p.read_text() for p in (ROOT / "cswap_lightning").rglob("*.py"))
    printed = re.sub(r'"\s*\n\s*f?"', "", source)  # join implicitly concatenated strings
    for message in listed:
        words = [re.escape(w) for w in message.replace("zvc", "{codec.name}").split(" ... ")]
        assert re.search(".*".join(words), printed), message
