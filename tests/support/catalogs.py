"""A live /metrics page against a catalog, both ways: what the page has that the catalog lacks or describes
otherwise, and what the catalog declares that the page lacks."""

from __future__ import annotations

from collections.abc import Mapping

from kvstack.board.catalogs import live_catalog
from kvstack.engines.names import MetricName


def disagreements(
    page: str, declared: Mapping[str, MetricName], *, conditional: bool = False, missing: bool = True
) -> list[str]:
    """Every way ``page`` and ``declared`` disagree: a family on the page that is not declared, of another
    kind, with a label not declared, or declared hidden; a declared family missing from the page (those with
    a ``when`` condition only when ``conditional``; none when not ``missing``)."""
    live = live_catalog(page, "live").metrics
    out = []
    for name, found in sorted(live.items()):
        want = declared.get(name)
        if want is None:
            out.append(f"{name} ({found.kind.value}) is on the page and not in the table")
            continue
        if found.kind.exposed_as != want.kind.exposed_as:
            out.append(f"{name} is a {found.kind.value} on the page, a {want.kind.value} in the table")
        if extra := found.labels - want.labels:
            out.append(f"{name} has labels {sorted(extra)} on the page that the table does not list")
        if want.hidden:
            out.append(f"{name} is on the page but hidden in the table")
    for name, want in sorted(declared.items() if missing else ()):
        if name not in live and not want.hidden and (conditional or not want.when):
            out.append(f"{name} ({want.kind.value}) is in the table and not on the page")
    return out
