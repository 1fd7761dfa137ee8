#!/usr/bin/env python3
"""Check that every PromQL expression in the Grafana dashboard (and, given as arguments, any other rule or
dashboard file) only names metrics that cifpool's code exports.

    python3 config/grafana/check_metrics.py                                   # the dashboard
    python3 config/grafana/check_metrics.py config/prometheus/alerts.yml      # ... and the alerts too

Known series are read from src/: the names given to metrics::{counter,gauge,histogram}! and any other
"cifpool_…_total" string literal (worker.rs passes counter names through a helper). A histogram `h`
exports h_bucket, h_sum and h_count, never `h` itself. Also checks that the dashboard is valid JSON with
unique panel ids and a ${DS_PROMETHEUS} datasource on every query. Exit 1 on any problem. Stdlib only.
"""

import json
import pathlib
import re
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "config" / "grafana" / "cifpool.json"

MACRO = re.compile(r'\b(counter|gauge|histogram)!\(\s*"([a-zA-Z_:][a-zA-Z0-9_:]*)"')
COUNTER_LITERAL = re.compile(r'"(cifpool_[a-z0-9_]+_total)"')
# A metric-looking token in PromQL: cifpool_… not followed by more name characters.
PROMQL_NAME = re.compile(r"\bcifpool_[a-zA-Z0-9_:]*")


def exported_series() -> tuple[dict[str, str], set[str]]:
    kinds: dict[str, str] = {}
    for path in sorted((ROOT / "src").rglob("*.rs")):
        text = path.read_text(encoding="utf-8")
        for kind, name in MACRO.findall(text):
            kinds[name] = kind
        for name in COUNTER_LITERAL.findall(text):
            kinds.setdefault(name, "counter")
    series = set()
    for name, kind in kinds.items():
        if kind == "histogram":
            series |= {f"{name}_bucket", f"{name}_sum", f"{name}_count"}
        else:
            series.add(name)
    return kinds, series


def dashboard_exprs(path: pathlib.Path, problems: list[str]) -> list[tuple[str, str]]:
    try:
        dash = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        problems.append(f"{path.name}: not valid JSON: {e}")
        return []
    out = []
    ids = []

    def walk(panels):
        for p in panels:
            ids.append(p.get("id"))
            for t in p.get("targets", []):
                ds = t.get("datasource") or p.get("datasource") or {}
                if ds.get("uid") != "${DS_PROMETHEUS}":
                    problems.append(f"{path.name}: panel {p.get('title')!r} query {t.get('refId')} does not use "
                                    "${DS_PROMETHEUS}")
                if not t.get("expr"):
                    problems.append(f"{path.name}: panel {p.get('title')!r} query {t.get('refId')} has no expr")
                out.append((f"panel {p.get('title')!r}", t.get("expr", "")))
            walk(p.get("panels", []))

    walk(dash.get("panels", []))
    dupes = {i for i in ids if ids.count(i) > 1}
    if dupes:
        problems.append(f"{path.name}: duplicate panel ids {sorted(dupes)}")
    for v in dash.get("templating", {}).get("list", []):
        q = v.get("query")
        if isinstance(q, dict):
            q = q.get("query", "")
        if v.get("type") == "query":
            out.append((f"variable ${v.get('name')}", q or ""))
    if dash.get("schemaVersion", 0) < 36:
        problems.append(f"{path.name}: schemaVersion {dash.get('schemaVersion')} is old")
    return out


def rule_exprs(path: pathlib.Path) -> list[tuple[str, str]]:
    import yaml  # only needed for rule files

    doc = yaml.safe_load(path.read_text(encoding="utf-8"))
    groups = doc.get("groups") or doc.get("spec", {}).get("groups", [])
    return [(f"rule {r.get('alert') or r.get('record')}", r["expr"]) for g in groups for r in g["rules"]]


def main(argv: list[str]) -> int:
    kinds, known = exported_series()
    if not kinds:
        print("no metrics found in src/: is this the cifpool tree?", file=sys.stderr)
        return 1
    problems: list[str] = []
    files = [DASHBOARD] + [pathlib.Path(a).resolve() for a in argv]
    used: set[str] = set()
    for path in files:
        exprs = dashboard_exprs(path, problems) if path.suffix == ".json" else rule_exprs(path)
        for where, expr in exprs:
            for name in PROMQL_NAME.findall(expr):
                used.add(name)
                if name not in known:
                    hint = " (a histogram: use _bucket, _sum or _count)" if kinds.get(name) == "histogram" else ""
                    problems.append(f"{path.relative_to(ROOT)}: {where}: unknown metric {name}{hint}")
        print(f"{path.relative_to(ROOT)}: {len(exprs)} expressions checked")
    unused = sorted(n for n in kinds if not any(s == n or s.startswith(n + "_") for s in used))
    if unused:
        print("exported but not shown:", ", ".join(unused))
    for p in problems:
        print("FAIL:", p)
    print(f"{len(kinds)} metrics exported by src/; {'OK' if not problems else f'{len(problems)} problem(s)'}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
