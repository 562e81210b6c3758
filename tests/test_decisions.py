"""Decisions are taken on typed fields, never on the words of a message (the house rule, docs/architecture.md):
no ``<x> in <err>.message``, ``in <marker>.error`` or ``in said`` in src/. A message is for people; the reason an
error or a marker carries (an enum, a flag) is what code reads."""

from __future__ import annotations

import re
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
DECISION = re.compile(r"""\bin\s+\(?[A-Za-z_][\w.]*(\(\))?\.(message|error)\b"""
                      r"""|\bin\s+\(?[A-Za-z_]\w*\.get\(["'](error|message)["'][^)]*\)"""
                      r"""|\bin\s+said\b|\bin\s+str\((e|err|exc|error)\)"""
                      r"""|(["']|\b[A-Z][A-Z_]{2,})\s+in\s+(ln|line)\b|\b(ln|line)\.startswith\(["']Traceback""")


def test_no_decision_reads_the_words_of_an_error_or_a_marker():
    found = []
    for path in sorted(SRC.rglob("*.py")):
        for n, line in enumerate(path.read_text().splitlines(), 1):
            code = line.split("#", 1)[0]
            if DECISION.search(code):
                found.append(f"{path.relative_to(SRC)}:{n}: {line.strip()}")
    assert not found, "decisions on message text (give the message a typed reason):\n" + "\n".join(found)


def test_the_pattern_finds_the_forms_it_forbids():
    for bad in ('if "peer rank" in err.message:', 'x = "lost a ring peer" in (mk.error or "")',
                'f = "lost" in (mk.get("error") or "")', 'if "gone" in model.get("error", ""):', 'if "; no heal for " not in said:',
                'any(d in e.message for d in DAMAGE)', 'if "timed out" in str(e):',
                'any(FOLLOWED in ln for ln in k.tail)', 'any("Error" in line for line in tail)',
                'ln.startswith("Traceback")'):
        assert DECISION.search(bad), bad
    for fine in ('self.message = message', 'for k in self.errors:', 'if "error" in msg:',
                 'useful = [ln for ln in lines if ok(ln)]', 'for line in f.tail:'):
        assert not DECISION.search(fine), fine
