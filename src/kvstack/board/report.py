"""How ``kvstack metrics check`` prints its findings: plain text grouped by file, or JSON.

Text: one block per file, each finding as ``severity code where`` with the message, the expression and the
fix on indented lines, then a summary line. JSON: ``{"findings": [...], "summary": {"errors", "warnings",
"files", "expressions"}}`` with each finding's fields as ``Finding`` names them.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence

from kvstack.board.check import Finding

__all__ = ["as_json", "as_text", "summary"]


def summary(findings: Sequence[Finding], files: int, expressions: int) -> dict[str, int]:
    errors = sum(f.severity == "error" for f in findings)
    return {"errors": errors, "warnings": len(findings) - errors, "files": files, "expressions": expressions}


def as_json(findings: Sequence[Finding], files: int, expressions: int) -> str:
    return json.dumps(
        {
            "findings": [dataclasses.asdict(f) for f in findings],
            "summary": summary(findings, files, expressions),
        },
        indent=2,
    )


def as_text(findings: Sequence[Finding], files: int, expressions: int) -> str:
    lines: list[str] = []
    by_file: dict[str, list[Finding]] = {}
    for finding in findings:
        by_file.setdefault(finding.file, []).append(finding)
    for file, group in by_file.items():
        lines.append(file)
        for f in group:
            lines.append(f"  {f.severity} {f.code}" + (f" {f.where}" if f.where else "") + f": {f.message}")
            if f.expression:
                lines.append(f"      expr: {' '.join(f.expression.split())}")
            if f.fix:
                lines.append(f"      fix: {f.fix}")
    counts = summary(findings, files, expressions)
    lines.append(
        f"{counts['errors']} error(s), {counts['warnings']} warning(s) in {files} file(s), "
        f"{expressions} expression(s) checked"
    )
    return "\n".join(lines)
