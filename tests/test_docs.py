"""The README and docs/ are the product's face: short, runnable, linked, and about the software only."""

from __future__ import annotations

import contextlib
import io
import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
SERVE = "python3 -m venv .venv && .venv/bin/pip install -e '.[test]' && .venv/bin/mmkv serve"
TEST = "python3 -m venv .venv && .venv/bin/pip install -e '.[test]' && .venv/bin/python -m pytest -q"
#: Words that tell how the project was made (numbered periods of work, training stages, checkpoint
#: codes, experiment rule files) rather than what the software does. `\s+` keeps this file clean.
HISTORY = re.compile(r"session\s+[0-9]|sessions?\s+[0-9]|stage\s+[0-9]|R25[a-z]|R3[a-z]\b|s4[78]-|work\s+period",
                     re.IGNORECASE)
#: Data the tests read (each checkpoint's training record), not prose.
HISTORY_EXEMPT = ("train_state.json",)
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def _markdown_files() -> list[Path]:
    return [README, *sorted((ROOT / "docs").glob("*.md"))]


def _tracked_files() -> list[Path]:
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout: the tracked files cannot be listed")
    out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    return [ROOT / p for p in out.decode().split("\0") if p]


def _text(path: Path) -> str | None:
    """The file's text, or None for a binary file (a NUL byte, or not UTF-8)."""
    data = path.read_bytes()
    if b"\0" in data[:8192]:
        return None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return None


def _without_code_blocks(text: str) -> str:
    return re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)


def test_readme_is_short_and_starts_with_the_two_setup_commands():
    """At most 250 lines; its first two commands, before any section, are the set-up commands:
    the server on the bundled model, then the tests, which CI runs verbatim."""
    lines = README.read_text().split("\n")
    assert len(lines) <= 250, f"README.md has {len(lines)} lines"
    first_section = next(i for i, line in enumerate(lines) if line.startswith("## "))
    commands = [line.strip() for line in lines[:first_section] if line.startswith("    ")]
    assert commands[:2] == [SERVE, TEST]
    assert (ROOT / ".ci" / "run").read_text().rstrip().endswith(TEST)


def test_no_tracked_text_file_tells_how_the_project_was_made():
    """No tracked text file names a numbered period of work, a training stage or a checkpoint's code name."""
    found = []
    for path in _tracked_files():
        if path.name in HISTORY_EXEMPT or not path.is_file():
            continue
        text = _text(path)
        if text is None:
            continue
        for n, line in enumerate(text.split("\n"), 1):
            if m := HISTORY.search(line):
                found.append(f"{path.relative_to(ROOT)}:{n}: {m.group(0)!r} in {line.strip()[:80]!r}")
    assert found == []


def test_the_history_pattern_finds_what_it_should():
    """The pattern above is not vacuous: it catches each kind of history word, and not product words."""
    # spelled in pieces, so that this file does not match its own pattern
    for bad in ("as of Session " + "12", "sessions " + "45-46", "stage " + "9", "the R25" + "o save", "R3" + "h",
                "s4" + "7-rules.md", "one work " + "period"):
        assert HISTORY.search(bad), bad
    for fine in ("a seeded agent session", "2 sessions)", "in stages", "R3 checkpoint", "staged 9"):
        assert not HISTORY.search(fine), fine


def test_relative_links_in_readme_and_docs_point_to_existing_files():
    """Every relative markdown link in README.md and docs/*.md names a file or folder that exists."""
    broken = []
    for doc in _markdown_files():
        for target in LINK.findall(_without_code_blocks(doc.read_text())):
            if re.match(r"[a-z]+:", target) or target.startswith("#"):
                continue  # a URL or an anchor in the same page
            path = (doc.parent / target.split("#", 1)[0]).resolve()
            if not path.exists():
                broken.append(f"{doc.relative_to(ROOT)}: {target}")
    assert broken == []
    assert LINK.findall("see [the guide](docs/guide.md) and [x](https://a.b)") == ["docs/guide.md", "https://a.b"]


def _readme_quickstart() -> tuple[str, list[str]]:
    """The README's quickstart code and the lines it says it prints (its `# ...` comments after the loop)."""
    block = README.read_text().split("## Quickstart", 1)[1].split("```python", 1)[1].split("```", 1)[0]
    printed = re.findall(r"^# (\S+ \d+ of \d+)", block, re.M)
    assert len(printed) == 2, block
    return block, printed


def test_readme_quickstart_answers_as_printed(monkeypatch):
    """The quickstart, run as written against the bundled model over HTTP: the two answers and
    cached-token counts it prints are the ones the README shows, and the second turn reuses more."""
    import mmkv
    from mmkv.server.app import ServerSettings, create_app
    from test_server import LiveServer

    code, printed = _readme_quickstart()
    server = LiveServer(create_app(mmkv.Engine.from_pretrained(None), ServerSettings()))
    monkeypatch.chdir(ROOT)  # the snippet opens samples/vqa/... as a user in the checkout would
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            exec(compile(code.replace("http://127.0.0.1:8000", server.base_url), "README quickstart", "exec"), {})
    finally:
        server.close()
    got = out.getvalue().strip().split("\n")
    assert got[:2] == printed
    first, second = (int(line.split()[1]) for line in printed)
    assert second > first > 0
    assert "'vision_tower_runs': 0" in got[2]
