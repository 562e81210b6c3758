"""All rendering in one place: stdout carries data only (--json), tables and messages go to stderr."""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass, field
from typing import Any

JSON_SCHEMA_VERSION = 1


def json_text(doc, indent: int | None = None) -> str:
    """JSON for stdout: UTF-8 text, except when a string holds what UTF-8 cannot encode (a path argument with an
    undecodable byte comes back as a lone surrogate): then every non-ASCII character is escaped, so the document
    stays valid JSON and writing it never fails."""
    text = json.dumps(doc, indent=indent, ensure_ascii=False)
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        text = json.dumps(doc, indent=indent, ensure_ascii=True)
    return text


@dataclass
class Output:
    json: bool = False
    quiet: bool = False
    _console: Any = field(default=None, repr=False)

    @property
    def console(self):
        if self._console is None:
            from rich.console import Console

            # Piped stderr (cron mail, logs) gets a wide fixed width instead of wrapping at 80 columns.
            width = None if sys.stderr.isatty() else 200
            self._console = Console(stderr=True, highlight=False, soft_wrap=False, width=width)
        return self._console

    @property
    def progress(self) -> bool:
        """Whether progress bars may be drawn: on a terminal's stderr, not with --json or --quiet."""
        return not self.json and not self.quiet and sys.stderr.isatty()

    def data(self, doc: dict) -> None:
        """The one JSON document of a --json run, on stdout."""
        doc = {"schema_version": JSON_SCHEMA_VERSION, **doc} if "schema_version" not in doc else doc
        sys.stdout.write(json_text(doc, indent=2) + "\n")
        sys.stdout.flush()

    def event(self, name: str, doc: dict) -> None:
        """One JSON line on stdout (a foreground `launch --json` follows the job with these)."""
        sys.stdout.write(json_text({"schema_version": JSON_SCHEMA_VERSION, "event": name, **doc}) + "\n")
        sys.stdout.flush()

    def line(self, text: str) -> None:
        """One plain line of data on stdout (an endpoint, a hash, a history entry); the caller decides when. What
        UTF-8 cannot encode (a lone surrogate from an undecodable path byte) is written as a backslash escape."""
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            text = text.encode("utf-8", "backslashreplace").decode("utf-8")
        sys.stdout.write(text + "\n")
        sys.stdout.flush()

    def info(self, message: str) -> None:
        """A human line on stderr; silent with --quiet or --json. Never read as markup (paths, remote text)."""
        if not self.quiet and not self.json:
            self.console.print(message, markup=False)

    def error(self, message: str) -> None:
        """A failure line on stderr: always shown, --json and --quiet included (cron mails it)."""
        print(f"error: {message}", file=sys.stderr, flush=True)

    def warn(self, message: str) -> None:
        if not self.quiet:
            from rich.text import Text

            self.console.print(Text("warning: ", style="yellow") + Text(message))

    def stream(self, text: str) -> None:
        """Streamed answer text: data, so stdout (not with --json, whose stdout is one document)."""
        if not self.json and not self.quiet:
            sys.stdout.write(text)
            sys.stdout.flush()

    def table(self, table) -> None:
        if not self.quiet and not self.json:
            self.console.print(table)


def esc(value) -> str:
    """Untrusted text (paths, node output, marker fields) in a table cell: shown literally, never as markup."""
    from rich.markup import escape

    return escape(str(value))


def human_bytes(n: int | None) -> str:
    if n is None:
        return "?"
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"


def deployment_table(dep) -> Any:
    from rich.table import Table

    t = Table(title=esc(f"deployment {dep.deployment_id}  placement {dep.placement}  backend {dep.backend}  "
                        f"{dep.parallel}/{dep.allocation}  {dep.schedule or 'overlap'}  batch {dep.batch_slots}"
                        + (f" of {dep.slots} slots that fit" if dep.slots is not None else "")
                        + f" x {dep.options.context} tokens"
                        + (f"  prompt cache {dep.prompt_cache_tokens} tokens" if dep.prompt_cache_tokens else "")
                        + kv_bits_note(dep)),
              title_justify="left", box=None, pad_edge=False)
    for col in ("RANK", "NODE", "HOST", "LAYERS", "RANGE", "WEIGHTS", "KV", "USED", "USABLE", "MODEL PATH"):
        t.add_column(col, justify="right" if col in ("RANK", "LAYERS", "WEIGHTS", "KV", "USED", "USABLE") else "left")
    for r in dep.ranks:
        t.add_row(str(r.rank), esc(r.node), esc(r.host), str(r.layers), esc(f"[{r.start_layer}, {r.end_layer})"),
                  human_bytes(r.planned.weights), human_bytes(r.planned.kv), human_bytes(r.planned.total),
                  human_bytes(r.usable_bytes), esc(dep.path_map.get(r.node, "")))
    return t


def kv_bits_note(dep) -> str:
    """plan --kv-bits in the table's title: the setting, and the context it lets fit (and without it)."""
    o = dep.options
    if o.kv_bits is None:
        return ""
    note = f"\nKV cache {o.kv_bits}-bit (groups of {o.kv_group_size}, from token {o.quantized_kv_start})"
    fit = dep.kv_fit
    if fit is not None and fit.max_context is not None:
        note += (f": up to {fit.max_context} tokens per sequence fit at batch {dep.batch_slots}, "
                 f"{fit.max_context_full} in full precision")
    return note


def _age(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    if seconds < 60:
        return f"{seconds:.1f}s"
    if seconds < 3600:
        return f"{seconds / 60:.0f}m"
    return f"{seconds / 3600:.1f}h"


STATE_STYLE = {"serving": "green", "ready": "green", "loading": "yellow", "stopping": "yellow", "stopped": "yellow", "failed": "red",
               "lost": "red", "dead": "red",
               "unreachable": "red", "no marker": "red"}


class FitTable:
    """A table that fits the terminal by leaving out its least important columns (``keep``: lower is kept
    longer) instead of squeezing every cell to "…"; the columns shown keep their order. The title is one line,
    cut with an ellipsis, and its ``short`` form (what matters first) when the whole one does not fit. Rendered
    when printed, so a live view adapts to every resize. Cells are markup (escape untrusted text with esc)."""

    def __init__(self, title: str, short: str, columns: list[tuple[str, str, int]]):
        self.title, self.short = title, short
        self.columns = columns  # (name, justify, keep)
        self.rows: list[list[str]] = []

    def add_row(self, *cells: str) -> None:
        self.rows.append(list(cells))

    def shown(self, width: int) -> list[int]:
        """The indices of the columns that fit in ``width`` cells (the first one always)."""
        from rich.text import Text

        need = [max([len(name)] + [Text.from_markup(row[i]).cell_len for row in self.rows])
                for i, (name, _, _) in enumerate(self.columns)]
        chosen: list[int] = []
        for i in sorted(range(len(self.columns)), key=lambda i: self.columns[i][2]):
            total = sum(need[j] for j in chosen) + need[i] + 2 * len(chosen)  # 2: the gap between two columns
            if not chosen or total <= width:
                chosen.append(i)
        return sorted(chosen)

    def __rich_console__(self, console, options):
        from rich.table import Table
        from rich.text import Text

        width = options.max_width
        title = Text.from_markup(self.title)
        if title.cell_len > width:
            title = Text.from_markup(self.short)
        title.no_wrap, title.overflow = True, "ellipsis"
        yield title
        t = Table(box=None, pad_edge=False)
        cols = self.shown(width)
        for i in cols:
            name, justify, _ = self.columns[i]
            t.add_column(name, justify=justify, no_wrap=True, overflow="ellipsis")
        for row in self.rows:
            t.add_row(*(row[i] for i in cols))
        yield t


def serving_line(defaults: dict | None) -> str:
    """status -a: rank 0's defaults for what a request leaves out."""
    if not defaults:
        return "request defaults: OpenAI's (temperature 1, top_p 1, max_tokens until the context is full)"
    return "request defaults: " + ", ".join(f"{k} {json.dumps(v) if isinstance(v, dict) else v}"
                                            for k, v in defaults.items())


def _job_state(job: dict) -> str:
    down = job.get("ranks_down")
    heal = job.get("heal")
    return esc(job["state"]) + (f" [red]{down}/{len(job['ranks'])} down[/red]" if down else "") + (
        (f" [red]{esc(heal['condition'])}[/]" if heal.get("condition") else
         f" [{HEAL_STYLE[heal['state']]}]{esc(heal['state'])}[/]") if heal else "")


HEAL_STYLE = {"serving": "green", "healing": "yellow", "degraded": "red"}


def heal_line(h: dict, *, plain: bool = False) -> str:
    """A supervisor's state (``status``, ``status --watch``): the cluster, serving / healing / degraded since
    when and why, heals so far, the time spent degraded, and whether its supervisor still runs. Markup, or
    ``plain`` text for a stderr line."""
    if plain:
        from rich.text import Text

        return Text.from_markup(heal_line(h)).plain
    sup = h.get("supervisor") or {}
    alive = h.get("supervisor_alive")
    who = f"supervisor pid {sup.get('pid', '?')}" + (" [red](dead)[/red]" if alive is False else "")
    reason = f": {esc(h['reason'])}" if h.get("reason") else ""
    if h.get("condition"):  # its supervisor is dead: what it last said is not what is
        return (f"heal {esc(h.get('cluster', ''))}: [red]{esc(h['condition'])}[/] (its last word: "
                f"{esc(h['state'])} since {esc(h.get('since', '?'))}{reason}); {h.get('heals', 0)} heal(s); "
                f"deployment {esc(h.get('deployment'))}; {who}")
    return (f"heal {esc(h.get('cluster', ''))}: [{HEAL_STYLE[h['state']]}]{esc(h['state'])}[/] since "
            f"{esc(h.get('since', '?'))}{reason}; {h.get('heals', 0)} heal(s), "
            f"{float(h.get('degraded_seconds') or 0):.0f} s degraded; deployment {esc(h.get('deployment'))}; {who}")


def status_table(job: dict, *, wide: bool = False) -> Any:
    coord = "detached" if job["detached"] else (
        f"coordinator pid {job['coordinator_pid']}" + ("" if job["coordinator_alive"] else " [red](dead)[/red]"))
    cols = [("RANK", 0), ("NODE", 2), ("HOST", 6), ("PID", 5), ("STATE", 1), ("LAYERS", 7), ("HEARTBEAT", 3),
            ("ACTIVE", 4)]
    if wide:
        cols += [("REQUESTS", 8), ("CANCEL EPOCH", 10), ("PROMPT CACHE", 11), ("ENDPOINT", 12), ("ERROR", 9)]
    t = FitTable(esc(f"{job['job_id']}  ") + _job_state(job) + esc(f"  {job['endpoint'] or ''}  ") + coord,
                 _job_state(job) + esc(f"  {job['job_id']}"), [(c, "left", k) for c, k in cols])
    for r in job["ranks"]:
        st = str(r["state"])
        style = STATE_STYLE.get(st, "")
        hb = _age(r["heartbeat_age"]) + (" [red]stale[/red]" if r["stale"] else "")
        layers = esc(f"[{r['layers'][0]}, {r['layers'][1]})") if r["layers"] and r["layers"][0] is not None else "-"
        row = [str(r["rank"]), esc(r["node"]), esc(r["host"]), str(r["pid"] or "-"),
               f"[{style}]{esc(st)}[/{style}]" if style else esc(st), layers, hb, str(r["active_requests"])]
        if wide:
            ids = r.get("active_request_ids") or []
            row += [esc(", ".join(ids[:3]) + (f" +{len(ids) - 3}" if len(ids) > 3 else "") or "-"),
                    str(r.get("cancel_epoch") if r.get("cancel_epoch") is not None else "-"),
                    _cache(r.get("prompt_cache")), esc(r["endpoint"] or "-"), esc(r["error"] or "")]
        t.add_row(*row)
    return t


# status --watch: the columns in their order, how they are aligned, and which stay longest on a narrow terminal
WATCH_COLUMNS = [("RANK", "left", 0), ("NODE", "left", 2), ("STATE", "left", 1), ("LAYERS", "left", 7),
                 ("BATCH", "right", 3), ("QUEUE", "right", 5), ("TOK/S", "right", 4), ("STEP", "right", 8),
                 ("IDLE", "right", 9), ("RSS", "right", 10), ("HEARTBEAT", "left", 6), ("CACHE", "left", 12),
                 ("LADDER", "left", 11)]


def watch_view(doc: dict) -> Any:
    """``status --watch``: per job, per rank its state, layers, batch, queue, tok/s, step time, RSS, heartbeat age
    and the peer-loss ladder's last stage; on a narrow terminal the columns that matter most (FitTable)."""
    from rich.console import Group

    tables = []
    for job in doc["jobs"]:
        now = time.strftime('%H:%M:%S')
        t = FitTable(esc(f"{job['job_id']}  ") + _job_state(job) + esc(f"  {job['endpoint'] or ''}  {now}"),
                     _job_state(job) + esc(f"  {now}  {job['job_id']}"), WATCH_COLUMNS)
        for r in job["ranks"]:
            st = str(r["state"])
            style = STATE_STYLE.get(st, "")
            pc = r.get("prompt_cache")
            t.add_row(str(r["rank"]), esc(r["node"]), f"[{style}]{esc(st)}[/{style}]" if style else esc(st),
                      esc(f"[{r['layers'][0]}, {r['layers'][1]})") if r["layers"] and r["layers"][0] is not None
                      else "-",
                      _num(r.get("batch")), _num(r.get("queued")),
                      f"{r['tok_s']:.1f}" if r.get("tok_s") is not None else "-",
                      f"{r['step_s'] * 1000:.1f} ms" if r.get("step_s") is not None else "-",
                      f"{r['idle_share'] * 100:.0f}%" if r.get("idle_share") is not None else "-",
                      human_bytes(r["rss_bytes"]) if r.get("rss_bytes") is not None else "-",
                      _age(r["heartbeat_age"]) + (" [red]stale[/red]" if r["stale"] else ""),
                      f"{pc[1]}/{pc[2]} tok" if pc else "-", esc(r.get("ladder") or "-"))
        tables.append(t)
    tables += [heal_line(h) for h in doc.get("heal") or []]
    return Group(*tables) if tables else "no launches"


def _cache(pc) -> str:
    """A rank's prompt cache: entries and tokens held of the tokens allowed."""
    return f"{pc[0]} entries, {pc[1]}/{pc[2]} tokens" if pc else "-"


def _num(v) -> str:
    return "-" if v is None else str(v)


def demo_summary_table(res) -> Any:
    from rich.table import Table

    t = Table(title=f"demo: {res.completion_tokens} tokens in {res.seconds:.2f} s = {res.tokens_per_second:.1f} tok/s, "
                    f"teardown {'verified' if res.teardown_ok else 'NOT verified'}", title_justify="left", box=None)
    for c in ("RANK", "NODE", "LAYERS", "RANGE", "PEAK RSS"):
        t.add_column(c)
    for r in res.ranks:
        t.add_row(str(r["rank"]), esc(r["node"]), str(r["layers"]), esc(f"[{r['range'][0]}, {r['range'][1]})"),
                  human_bytes(r["peak_rss_bytes"]))
    return t


SYNC_STYLE = {"ok": "green", "missing": "yellow", "partial": "yellow", "stale": "red", "unreachable": "red",
              "error": "red", "failed": "red", "would-sync": "yellow"}


def _styled(value: str | None) -> str:
    v = value or "-"
    style = SYNC_STYLE.get(v, "")
    return f"[{style}]{esc(v)}[/{style}]" if style else esc(v)


def sync_table(doc: dict) -> Any:
    """A sync report (SyncReport.to_json): one row per node, before and after."""
    from rich.table import Table

    src = f"  from {doc['source']} ({doc['mode']})" if doc.get("source") else ""
    t = Table(title=esc(f"sync {doc['deployment_id']}  manifest {doc['manifest_hash'][:19]}...{src}"),
              title_justify="left", box=None, pad_edge=False)
    for c in ("NODE", "PATH", "BEFORE", "FILES", "BYTES", "AFTER", "DETAIL"):
        t.add_column(c, justify="right" if c in ("FILES", "BYTES") else "left")
    for n in doc["nodes"]:
        t.add_row(esc(n["node"]), esc(n["path"]), _styled(n["state"]), str(n["files_needed"]),
                  human_bytes(n["bytes_needed"]), _styled(n["result"]), esc(n["error"] or n["detail"] or ""))
    return t


class SyncView:
    """Renders sync events: JSON lines on stdout (``--json``), Rich progress bars on a terminal, else nothing
    but errors (cron). Call as ``emit``; ``close()`` when the sync returns."""

    def __init__(self, out: Output):
        self.out = out
        self.progress = None
        self.tasks: dict[str, tuple[Any, int]] = {}  # node -> (progress task, total bytes)
        self.live = out.progress

    def __call__(self, event: dict) -> None:
        if self.out.json:
            sys.stdout.write(json.dumps(event, ensure_ascii=False, separators=(",", ":")) + "\n")
            sys.stdout.flush()
            return
        kind = event["event"]
        if kind == "error":
            self._stop_bar(event["node"])
            self.out.error(f"{event['node']}: {event['error']}")
            return
        if not self.live:
            return
        if kind == "start":
            bar = self._bars()
            total = max(1, event["bytes"])
            self.tasks[event["node"]] = (bar.add_task(esc(event["node"]), total=total), total)
        elif kind == "progress" and event["node"] in self.tasks:
            self._bars().update(self.tasks[event["node"]][0], completed=event["bytes"])
        elif kind == "done":
            self._stop_bar(event["node"], complete=True)

    def _bars(self):
        if self.progress is None:
            from rich.progress import (BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn,
                                       TransferSpeedColumn)

            self.progress = Progress(TextColumn("{task.description}"), BarColumn(), DownloadColumn(),
                                     TransferSpeedColumn(), TimeRemainingColumn(), console=self.out.console)
            self.progress.start()
        return self.progress

    def _stop_bar(self, node: str, complete: bool = False) -> None:
        if self.progress is not None and node in self.tasks:
            task, total = self.tasks.pop(node)
            if complete:
                self.progress.update(task, completed=total)

    def close(self) -> None:
        if self.progress is not None:
            self.progress.stop()
            self.progress = None


def history_line(cluster: str, e: dict, *, kept: bool) -> str:
    """One applied replan, as `clusterctl history` prints it on stdout (``kept``: the old file still exists)."""
    return (f"{cluster}  {e['applied_at']}  {e['from']} ({e['from_hash'][:12]}){'' if kept else ' [file gone]'}"
            f" -> {e['to']} ({e['to_hash'][:12]})  {'; '.join(e.get('changes') or [])}"
            + (f"  ({e['kind']})" if e.get("kind") else ""))
