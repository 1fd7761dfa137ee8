#!/usr/bin/env python3
"""Check the Grafana dashboard and (given as arguments) the Prometheus rule files against the code and
against a few conventions.

    python3 config/grafana/check_metrics.py                                   # the dashboard
    python3 config/grafana/check_metrics.py config/prometheus/alerts.yml      # ... and the alerts too

Metric names. Every metric an expression names must be exported:
  - cifpool_*: read from src/: the names given to metrics::{counter,gauge,histogram}! and any other
    "cifpool_…_total" string literal (worker.rs passes counter names through a helper). A histogram `h`
    exports h_bucket, h_sum and h_count, never `h` itself;
  - process_*: the fixed set the metrics-process crate exports (PROCESS_SERIES; not named in src/);
  - `up` (Prometheus itself) and kube_* (kube-state-metrics) are external and always accepted.
A name counts as a metric when it has one of those prefixes or is followed by a selector `{…}`; text
inside quotes (label values, regexes) is ignored.

Dashboard: valid JSON, unique panel ids, top-level panels that do not overlap, a ${DS_PROMETHEUS}
datasource on every query; every range is [$__rate_interval] (no fixed [5m]); every metric selector of
a panel carries job=~"$job", namespace=~"$namespace" and instance=~"$instance".

Rule files: every alert has a runbook_url annotation (and no old `runbook` one); a runbook_url into
docs/OPERATIONS.md must name the anchor of one of its headings; every `by (…)` and `on (…)` clause names
namespace and cluster, no `without (…)` drops them, and no aggregation has no clause at all (`sum(x)`
merges every namespace into one series).

Exit 1 on any problem. Stdlib only, plus PyYAML for rule files.
"""

import json
import pathlib
import re
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "config" / "grafana" / "cifpool.json"
OPERATIONS = ROOT / "docs" / "OPERATIONS.md"

MACRO = re.compile(r'\b(counter|gauge|histogram)!\(\s*"([a-zA-Z_:][a-zA-Z0-9_:]*)"')
COUNTER_LITERAL = re.compile(r'"(cifpool_[a-z0-9_]+_total)"')

# Exported by the metrics-process crate (the process collector), never named in src/.
PROCESS_SERIES = {
    "process_cpu_seconds_total",
    "process_open_fds",
    "process_max_fds",
    "process_virtual_memory_bytes",
    "process_virtual_memory_max_bytes",
    "process_resident_memory_bytes",
    "process_start_time_seconds",
    "process_threads",
}
EXTERNAL_NAMES = {"up"}  # Prometheus's own series
EXTERNAL_PREFIXES = ("kube_",)  # kube-state-metrics

# Metric-looking tokens: our prefixes, `up`, or any name directly followed by a selector.
PREFIXED = re.compile(r"(?<![\w:$])(cifpool_[\w:]*|process_[\w:]*|kube_[\w:]*|up)(?![\w:])")
BEFORE_SELECTOR = re.compile(r"(?<![\w:$])([a-zA-Z_:][\w:]*)\s*\{")
KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "offset", "and", "or",
            "unless"}

REQUIRED_MATCHERS = {
    "job": re.compile(r'\bjob\s*=~\s*"\$job"'),
    "namespace": re.compile(r'\bnamespace\s*=~\s*"\$namespace"'),
    "instance": re.compile(r'\binstance\s*=~\s*"\$instance"'),
}
ALLOWED_RANGES = {"$__rate_interval", "${__rate_interval}"}
KEEP_LABELS = ("namespace", "cluster")
AGGREGATIONS = ("sum", "min", "max", "avg", "group", "count", "stddev", "stdvar", "topk", "bottomk",
                "quantile", "count_values", "limitk", "limit_ratio")
BARE_AGGREGATION = re.compile(r"(?<![\w:])(" + "|".join(AGGREGATIONS) + r")\s*\(")
CLAUSE = re.compile(r"(?<![\w:])(by|on|without)\s*\(([^()]*)\)")


def mask(expr: str) -> str:
    """expr with the inside of every string literal and comment blanked, offsets unchanged."""

    def blank(m: re.Match) -> str:
        s = m.group(0)
        if s.startswith("#"):
            return " " * len(s)
        return s[0] + " " * (len(s) - 2) + s[-1]

    return re.sub(r'"(?:[^"\\\n]|\\.)*"|\'(?:[^\'\\\n]|\\.)*\'|`[^`]*`|#[^\n]*', blank, expr)


def closing(masked: str, open_at: int, pair: str = "()") -> int:
    """Index of the bracket closing the one at open_at (-1 if unbalanced)."""
    depth = 0
    for i in range(open_at, len(masked)):
        if masked[i] == pair[0]:
            depth += 1
        elif masked[i] == pair[1]:
            depth -= 1
            if depth == 0:
                return i
    return -1


def metric_names(expr: str) -> list[tuple[str, int]]:
    """(name, offset) of every metric-looking token of expr."""
    masked = mask(expr)
    found = {m.start(1): m.group(1) for m in PREFIXED.finditer(masked)}
    for m in BEFORE_SELECTOR.finditer(masked):
        if m.group(1) not in KEYWORDS:
            found.setdefault(m.start(1), m.group(1))
    return sorted(((name, at) for at, name in found.items()), key=lambda x: x[1])


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


def heading_anchors(path: pathlib.Path) -> set[str]:
    """GitHub's anchors for the headings of a Markdown file."""
    anchors: set[str] = set()
    seen: dict[str, int] = {}
    in_code = False
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.startswith("```"):
            in_code = not in_code
        m = re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if in_code or not m:
            continue
        slug = re.sub(r"[^\w\- ]", "", m.group(1).strip().lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        anchors.add(slug if n == 0 else f"{slug}-{n}")
    return anchors


def check_dashboard_expr(where: str, expr: str, problems: list[str]) -> None:
    masked = mask(expr)
    for m in re.finditer(r"\[([^\]]*)\]", masked):
        if m.group(1).strip() not in ALLOWED_RANGES:
            problems.append(f"{where}: range [{m.group(1)}] must be [$__rate_interval]")
    for name, at in metric_names(expr):
        rest = masked[at + len(name):]
        lead = len(rest) - len(rest.lstrip())
        if not rest[lead:].startswith("{"):
            problems.append(f"{where}: {name} has no selector (needs {', '.join(REQUIRED_MATCHERS)})")
            continue
        start = at + len(name) + lead
        end = closing(masked, start, "{}")
        selector = expr[start + 1:end] if end > 0 else ""
        missing = [label for label, rx in REQUIRED_MATCHERS.items() if not rx.search(selector)]
        if missing:
            wanted = ", ".join(f'{m}=~"${m}"' for m in missing)
            problems.append(f"{where}: selector of {name} lacks {wanted}")


def dashboard_exprs(path: pathlib.Path, problems: list[str]) -> list[tuple[str, str]]:
    try:
        dash = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        problems.append(f"{path.relative_to(ROOT)}: not valid JSON: {e}")
        return []
    out = []
    ids = []

    def walk(panels):
        for p in panels:
            ids.append(p.get("id"))
            for t in p.get("targets", []):
                where = f"{path.relative_to(ROOT)}: panel {p.get('title')!r} query {t.get('refId')}"
                ds = t.get("datasource") or p.get("datasource") or {}
                if ds.get("uid") != "${DS_PROMETHEUS}":
                    problems.append(f"{where} does not use ${{DS_PROMETHEUS}}")
                if not t.get("expr"):
                    problems.append(f"{where} has no expr")
                check_dashboard_expr(where, t.get("expr", ""), problems)
                out.append((f"panel {p.get('title')!r}", t.get("expr", "")))
            walk(p.get("panels", []))

    walk(dash.get("panels", []))
    dupes = {i for i in ids if ids.count(i) > 1}
    if dupes:
        problems.append(f"{path.relative_to(ROOT)}: duplicate panel ids {sorted(dupes)}")
    # Top-level panels (rows included) must not overlap; panels inside a collapsed row are laid out
    # only when it opens.
    cells: dict[tuple[int, int], str] = {}
    for p in dash.get("panels", []):
        g = p.get("gridPos") or {}
        x, y, w, h = (g.get(k, 0) for k in ("x", "y", "w", "h"))
        if x + w > 24:
            problems.append(f"{path.relative_to(ROOT)}: panel {p.get('title')!r} is wider than the grid "
                            f"(x {x} + w {w} > 24)")
        for cx in range(x, x + w):
            for cy in range(y, y + h):
                other = cells.setdefault((cx, cy), p.get("title"))
                if other != p.get("title"):
                    problems.append(f"{path.relative_to(ROOT)}: panels {other!r} and {p.get('title')!r} overlap")
                    break
            else:
                continue
            break
    for v in dash.get("templating", {}).get("list", []):
        q = v.get("query")
        if isinstance(q, dict):
            q = q.get("query", "")
        if v.get("type") == "query":
            out.append((f"variable ${v.get('name')}", q or ""))
    if dash.get("schemaVersion", 0) < 36:
        problems.append(f"{path.relative_to(ROOT)}: schemaVersion {dash.get('schemaVersion')} is old")
    return out


def check_rule(where: str, rule: dict, anchors: set[str], problems: list[str]) -> None:
    expr = rule.get("expr", "")
    masked = mask(expr)
    for m in CLAUSE.finditer(masked):
        kind, labels = m.group(1), {s.strip() for s in m.group(2).split(",") if s.strip()}
        if kind == "without":
            dropped = [label for label in KEEP_LABELS if label in labels]
            if dropped:
                problems.append(f"{where}: `without ({m.group(2)})` drops {', '.join(dropped)}")
        else:
            missing = [label for label in KEEP_LABELS if label not in labels]
            if missing:
                problems.append(f"{where}: `{kind} ({m.group(2)})` lacks {', '.join(missing)}")
    for m in BARE_AGGREGATION.finditer(masked):
        end = closing(masked, m.end() - 1)
        if end < 0 or not re.match(r"\s*(by|without)\s*\(", masked[end + 1:]):
            problems.append(f"{where}: `{m.group(1)}(…)` without by/without merges every namespace and cluster")
    if "alert" not in rule:
        return
    annotations = rule.get("annotations") or {}
    if "runbook" in annotations:
        problems.append(f"{where}: annotation `runbook` was renamed `runbook_url`")
    url = annotations.get("runbook_url")
    if not url:
        problems.append(f"{where}: no runbook_url annotation")
    elif not re.match(r"https?://\S+$", url):
        problems.append(f"{where}: runbook_url {url!r} is not a URL")
    elif "OPERATIONS.md#" in url and url.rsplit("#", 1)[1] not in anchors:
        problems.append(f"{where}: runbook_url anchor #{url.rsplit('#', 1)[1]} is no heading of "
                        f"{OPERATIONS.relative_to(ROOT)}")


def rule_exprs(path: pathlib.Path, problems: list[str]) -> list[tuple[str, str]]:
    import yaml  # only needed for rule files

    doc = yaml.safe_load(path.read_text(encoding="utf-8"))
    groups = doc.get("groups") or doc.get("spec", {}).get("groups", [])
    anchors = heading_anchors(OPERATIONS) if OPERATIONS.exists() else set()
    out = []
    for g in groups:
        for r in g["rules"]:
            name = f"rule {r.get('alert') or r.get('record')}"
            check_rule(f"{path.relative_to(ROOT)}: {name}", r, anchors, problems)
            out.append((name, r["expr"]))
    return out


def main(argv: list[str]) -> int:
    kinds, known = exported_series()
    if not kinds:
        print("no metrics found in src/: is this the cifpool tree?", file=sys.stderr)
        return 1
    problems: list[str] = []
    files = [DASHBOARD] + [pathlib.Path(a).resolve() for a in argv]
    used: set[str] = set()
    for path in files:
        exprs = dashboard_exprs(path, problems) if path.suffix == ".json" else rule_exprs(path, problems)
        for where, expr in exprs:
            for name, _ in metric_names(expr):
                used.add(name)
                if name in known or name in PROCESS_SERIES or name in EXTERNAL_NAMES:
                    continue
                if name.startswith(EXTERNAL_PREFIXES):
                    continue
                if kinds.get(name) == "histogram":
                    hint = " (a histogram: use _bucket, _sum or _count)"
                elif name.startswith("process_"):
                    hint = " (not one of the metrics-process series)"
                else:
                    hint = " (not exported by src/)"
                problems.append(f"{path.relative_to(ROOT)}: {where}: unknown metric {name}{hint}")
        print(f"{path.relative_to(ROOT)}: {len(exprs)} expressions checked")
    def shown(name: str) -> bool:
        if kinds[name] == "histogram":
            return any(f"{name}_{suffix}" in used for suffix in ("bucket", "sum", "count"))
        return name in used

    unused = sorted(n for n in kinds if not shown(n))
    if unused:
        print("exported but not shown:", ", ".join(unused))
    for p in problems:
        print("FAIL:", p)
    print(f"{len(kinds)} metrics exported by src/; {'OK' if not problems else f'{len(problems)} problem(s)'}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
