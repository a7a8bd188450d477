"""The soak's judgement: the checks on the requests, the faults, the settled service and its memory, and the
markdown tables of the results."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from checks.soak.client import FAILURES, Result
from checks.soak.faults import Fault
from checks.soak.memory import RSS_GROWTH_LIMIT, RssRow
from checks.soak.service import CLIENT_DEADLINE_S, SETTLE_BOUND_S

EXPECTED_REFUSALS = {429, 503, 504}  # what a valid request may get under faults and load


@dataclass
class Report:
    duration_s: float
    results: list[Result]
    faults: list[Fault]
    rss: list[RssRow]
    checks: list[tuple[str, bool, str]] = field(default_factory=list)
    log_path: Path | None = None

    @property
    def failures(self) -> list[str]:
        return [f"{name}: {detail}" for name, ok, detail in self.checks if not ok]

    def check(self, name: str, ok: bool, detail: str = "") -> None:
        self.checks.append((name, bool(ok), detail))

    def markdown(self) -> str:
        return "\n\n".join((self._outcomes(), self._faults(), self._rss(), self._checks()))

    def _outcomes(self) -> str:
        good = Counter(r.row for r in self.results if not r.bad)
        bad = Counter(r.row for r in self.results if r.bad)
        lines = [f"Requests by outcome ({len(self.results)} in {self.duration_s:.0f} s)", "",
                 "| outcome | valid requests | bad bodies |", "|---|---:|---:|"]
        for row in sorted(set(good) | set(bad), key=_outcome_order):
            lines.append(f"| {row} | {good.get(row, 0)} | {bad.get(row, 0)} |")
        return "\n".join(lines)

    def _faults(self) -> str:
        lines = ["Faults injected", "", "| at | fault | target | recovered after | note |", "|---:|---|---|---:|---|"]
        for f in self.faults:
            back = f"{f.recovered_s:.1f} s" if f.recovered_s is not None else "NOT RECOVERED"
            note = f"{f.note}; **BROKEN**: {f.broken}" if f.broken else f.note
            lines.append(f"| {f.at_s:.0f} s | {f.name} | {f.target} | {back} | {note} |")
        return "\n".join(lines)

    def _rss(self) -> str:
        lines = ["RSS per process (start: the peak of its first window; end: its last sample)", "",
                 "| process | pid | peak at | last sample | start MiB | end MiB | growth | note |",
                 "|---|---:|---:|---:|---:|---:|---:|---|"]
        for r in self.rss:
            start = f"{r.start_s:.0f} s" if r.start_s is not None else "-"
            then = f"{r.start_mib:.0f}" if r.start_mib is not None else "-"
            growth = f"{r.growth:+.1%}" if r.growth is not None else "-"
            lines.append(f"| {r.name} | {r.pid} | {start} | {r.end_s:.0f} s | {then} | {r.end_mib:.0f} | {growth} "
                         f"| {r.note} |")
        return "\n".join(lines)

    def _checks(self) -> str:
        lines = ["Checks", "", "| check | result | detail |", "|---|---|---|"]
        lines += [f"| {name} | {'ok' if ok else '**FAILED**'} | {detail} |" for name, ok, detail in self.checks]
        return "\n".join(lines)


def _outcome_order(row: str) -> tuple:
    first = row.split()[0]
    rank = {"completed": 0, "client": 1}.get(first, 3 if first.isdigit() else 2 if first == "stream" else 4)
    return rank, row


def judge_requests(report: Report, stuck_threads: int) -> None:
    failed = [r for r in report.results if r.outcome in FAILURES]
    report.check("every request ended in one outcome its client saw", not failed and not stuck_threads,
                 _examples(failed) or f"{len(report.results)} requests; {stuck_threads} client threads stuck")
    hung = [r for r in failed if r.outcome == "hang"]
    report.check(f"no request hung past {CLIENT_DEADLINE_S} s", not hung, _examples(hung))
    fives = [r for r in failed if r.outcome in ("http 500", "server fault in stream")]
    report.check("no 500 (nor its equivalent error event in a stream)", not fives, _examples(fives))
    bad = [r for r in report.results if r.bad]
    unrefused = [r for r in bad if not (r.outcome == "error" and 400 <= r.status < 500)]
    report.check("every bad body got a 4xx with an OpenAI-style error", bad and not unrefused,
                 _examples(unrefused) or f"{len(bad)} bad bodies")
    valid = [r for r in report.results if not r.bad]
    odd = [r for r in valid if r.outcome == "error" and r.status and r.status not in EXPECTED_REFUSALS]
    report.check("valid requests were refused only for load or faults (429/503/504)", not odd, _examples(odd))
    completed = sum(r.outcome == "completed" for r in valid)
    report.check("the service did real work", completed > 0, f"{completed} of {len(valid)} valid requests completed")


def judge_faults(report: Report) -> None:
    lost = [f"{f.name} at {f.at_s:.0f} s: {f.broken or 'not recovered'}" for f in report.faults
            if f.recovered_s is None or f.broken]
    report.check("every fault was recovered from, with no promise broken meanwhile", report.faults and not lost,
                 "; ".join(lost) or f"{len(report.faults)} faults")
    frozen = [f for f in report.faults if f.name.startswith("SIGSTOP")]
    report.check("a frozen worker is declared stuck and replaced",
                 all("killed and restarted" in f.note for f in frozen),
                 "; ".join(f.note for f in frozen) or "no freeze injected")


def judge_service(report: Report, settled: tuple, probes: dict, exit_code, left: list[str], seen: int) -> None:
    settle_s, metrics = settled
    report.check("the service settled: running = waiting = 0, no KV blocks used", settle_s is not None,
                 f"after {settle_s:.1f} s" if settle_s is not None else f"still {metrics} after {SETTLE_BOUND_S:.0f} s")
    report.check("every class is still served after the soak", all(v == "completed" for v in probes.values()),
                 ", ".join(f"{k}: {v}" for k, v in probes.items()))
    grown = [f"{r.name} {r.growth:+.1%}" for r in report.rss if r.growth is not None and r.growth >= RSS_GROWTH_LIMIT]
    report.check(f"no process's RSS grew by {RSS_GROWTH_LIMIT:.0%} or more", not grown, ", ".join(grown) or
                 f"{sum(r.growth is not None for r in report.rss)} processes compared")
    report.check("the gateway exited 0 on SIGTERM", exit_code == 0, f"exit code {exit_code}")
    report.check("no process outlived the service", not left, ", ".join(left) or f"{seen} processes seen")


def _examples(results: list[Result], n: int = 3) -> str:
    if not results:
        return ""
    shown = "; ".join(f"{r.label} sent at {r.at_s:.0f} s: {r.row} {r.detail}".strip() for r in results[:n])
    return f"{len(results)}: {shown}"
