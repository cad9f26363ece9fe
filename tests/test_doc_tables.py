"""docs/eval.md quotes the bundled models' eval reports: its tables must be the reports' tables."""

from __future__ import annotations

import pytest

from mmkv.vqa_eval import doc_tables as T


def test_eval_doc_quotes_the_current_reports():
    """Every results table docs/eval.md quotes for a bundled tiny model is the one in its
    docs/eval-runs report (rerun `python -m vqa_eval.doc_tables` after `mmkv eval`)."""
    doc = T.DOC.read_text()
    new, changed = T.embed(doc, T.load_reports())
    assert changed == [], changed
    assert new == doc
    assert T.main(["--check"]) == 0


@pytest.mark.parametrize("section", ["", "#### Proxy"])
def test_a_stale_table_is_found_and_rewritten(tmp_path, section):
    """A changed cell is reported by --check (exit 1, file untouched) and restored by a rewrite, in
    the first section and in the proxy's; a quoted table no report holds is refused by name."""
    doc = T.DOC.read_text()
    lines = doc.split("\n")
    start = next(i for i, x in enumerate(lines) if x.startswith(section))
    row = next(i for i in range(start, len(lines)) if lines[i].startswith("| splice-k1 | "))
    lines[row] = lines[row].replace("/1080", "/1081", 1)  # a count no report holds, whatever the verdict
    assert lines[row] != doc.split("\n")[row]
    stale = tmp_path / "eval.md"
    stale.write_text("\n".join(lines))
    assert T.main(["--doc", str(stale), "--check"]) == 1
    assert stale.read_text() == "\n".join(lines)
    assert T.main(["--doc", str(stale)]) == 0
    assert stale.read_text() == doc
    head = next(i for i, x in enumerate(lines) if x.startswith("| arm | agreement"))
    lines[head] = "| arm | made-up column |"
    with pytest.raises(ValueError, match="made-up column"):
        T.embed("\n".join(lines), T.load_reports())
