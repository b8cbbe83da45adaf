"""The runner: selects tests, drives one zygote per framework, classifies, reports.

``python -m conformance [--suite S ...] [-k PATTERN ...] [--framework rrpc|torch|both]``
Tests run one at a time; with both frameworks each test runs on torch, then on
rrpc, before the next one starts.

At the end it prints the table the README shows (per suite, then all suites)
and exits 1 when a test failed that it may not: on rrpc, a failure (fail,
timeout, error) that is neither a known difference (``known_differences.py``)
nor environment-broken (torch failed it too, here); with ``--framework torch``
alone, any failure on torch. Otherwise it exits 0.
"""

from __future__ import annotations

import argparse
import fnmatch
import importlib.metadata
import json
import os
import select
import subprocess
import sys
import time
from collections import Counter, defaultdict
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from conformance.known_differences import KNOWN_DIFFERENCES
from conformance.not_applicable import not_applicable_reason
from conformance.suites import FRAMEWORKS, SUITES
from conformance.timeouts import timeout_for

ROOT = Path(__file__).resolve().parent.parent
OUT = Path(__file__).resolve().parent / "out"
START_TIMEOUT = 180.0  # seconds for a zygote to import everything
ZYGOTE_GRACE = 60.0  # beyond a test's own timeout, before the zygote itself is deemed stuck

OUTCOMES = ("pass", "fail", "timeout", "skipped", "error")


class Zygote:
    """One ``conformance.zygote`` process and its command / result pipes."""

    def __init__(self, framework: str, log_dir: Path) -> None:
        self.framework = framework
        self.log_dir = log_dir
        log_dir.mkdir(parents=True, exist_ok=True)
        cmd_read, cmd_write = os.pipe()
        res_read, res_write = os.pipe()
        self._log = open(log_dir / "zygote.log", "ab")  # noqa: SIM115 -- closed in close()
        self.process = subprocess.Popen(
            [sys.executable, "-m", "conformance.zygote", framework, str(cmd_read), str(res_write)],
            pass_fds=(cmd_read, res_write),
            cwd=ROOT,
            stdin=subprocess.DEVNULL,
            stdout=self._log,
            stderr=subprocess.STDOUT,
        )
        os.close(cmd_read)
        os.close(res_write)
        self._commands = os.fdopen(cmd_write, "w")
        self._results = res_read
        self._buffer = b""
        ready = self._read(START_TIMEOUT)
        if ready is None or "error" in ready:
            self.close()
            detail = ready["error"] if ready else "no answer"
            raise RuntimeError(f"{framework} zygote did not start: {detail}")

    def _read(self, timeout: float) -> dict[str, Any] | None:
        deadline = time.monotonic() + timeout
        while b"\n" not in self._buffer:
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            ready, _, _ = select.select([self._results], [], [], left)
            if not ready:
                return None
            chunk = os.read(self._results, 1 << 16)
            if not chunk:
                return None
            self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        return json.loads(line)

    def request(self, message: dict[str, Any], timeout: float) -> dict[str, Any] | None:
        try:
            self._commands.write(json.dumps(message) + "\n")
            self._commands.flush()
        except BrokenPipeError:
            return None
        return self._read(timeout)

    def alive(self) -> bool:
        return self.process.poll() is None

    def close(self) -> None:
        try:
            self._commands.write(json.dumps({"op": "exit"}) + "\n")
            self._commands.close()
        except (BrokenPipeError, ValueError, OSError):
            pass
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        os.close(self._results)
        self._log.close()


class Frameworks:
    """The zygotes in use; a zygote that died or got stuck is replaced before the next test."""

    def __init__(self, frameworks: Iterable[str], log_root: Path) -> None:
        self.log_root = log_root
        self.zygotes: dict[str, Zygote] = {}
        for framework in frameworks:
            self.zygotes[framework] = Zygote(framework, log_root / framework)

    def run(self, framework: str, test: str, timeout: float) -> dict[str, Any]:
        zygote = self.zygotes[framework]
        if not zygote.alive():
            zygote.close()
            zygote = self.zygotes[framework] = Zygote(framework, self.log_root / framework)
        message = {
            "op": "run",
            "test": test,
            "timeout": timeout,
            "log_dir": str(self.log_root / framework),
        }
        result = zygote.request(message, timeout + ZYGOTE_GRACE)
        if result is None:
            zygote.process.kill()
            zygote.close()
            self.zygotes[framework] = Zygote(framework, self.log_root / framework)
            return {"outcome": "error", "reason": "the zygote died or stopped answering"}
        result.pop("op", None)
        result.pop("test", None)
        return result

    def list_tests(self) -> dict[str, str]:
        zygote = next(iter(self.zygotes.values()))
        answer = zygote.request({"op": "list"}, START_TIMEOUT)
        if answer is None:
            raise RuntimeError("the zygote did not list its tests")
        return answer["tests"]

    def close(self) -> None:
        for zygote in self.zygotes.values():
            zygote.close()


# -- Classification and reporting ----------------------------------------------
def short_reason(result: dict[str, Any]) -> str:
    """One line: the exception a failing rank raised, or the verdict's own reason."""
    if result.get("missing_apis") and result["outcome"] != "pass":
        return "missing: " + ", ".join(result["missing_apis"])
    text = result.get("reason", "")
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    for line in reversed(lines):
        head = line.split(":", 1)[0]
        if head and " " not in head and (head[0].isupper() or "." in head):
            return line[:300]
    return (lines[-1] if lines else "")[:300]


def classify(entry: dict[str, Any]) -> None:
    """Mark an entry environment-broken when torch ran it and it did not pass there."""
    torch_result = entry.get("torch")
    entry["env_broken"] = bool(
        torch_result
        and not entry.get("na")
        and torch_result["outcome"] in ("fail", "timeout", "error")
    )
    rrpc_result = entry.get("rrpc")
    difference = KNOWN_DIFFERENCES.get(entry["test"])
    if difference and rrpc_result and rrpc_result["outcome"] in ("fail", "timeout", "error"):
        entry["known_difference"] = difference


def totals(entries: list[dict[str, Any]], frameworks: Iterable[str]) -> dict[str, Any]:
    """Per suite and framework: counts of each outcome, not applicable, environment-broken."""
    table: dict[str, dict[str, Counter[str]]] = defaultdict(lambda: defaultdict(Counter))
    for entry in entries:
        for framework in frameworks:
            counts = table[entry["suite"]][framework]
            if entry.get("na"):
                counts["na"] += 1
            elif framework == "rrpc" and entry.get("env_broken"):
                counts["env_broken"] += 1
            elif framework == "rrpc" and entry.get("known_difference"):
                counts["known_diff"] += 1
            elif framework in entry:
                counts[entry[framework]["outcome"]] += 1
    result: dict[str, Any] = {}
    for suite, by_framework in table.items():
        result[suite] = {framework: dict(counts) for framework, counts in by_framework.items()}
    overall: dict[str, Counter[str]] = defaultdict(Counter)
    for by_framework in table.values():
        for framework, counts in by_framework.items():
            overall[framework].update(counts)
    result["ALL"] = {framework: dict(counts) for framework, counts in overall.items()}
    return result


# The README's columns: (key in totals(), heading).
COLUMNS = (
    ("pass", "pass"),
    ("fail", "fail"),
    ("timeout", "timeout"),
    ("error", "error"),
    ("known_diff", "known difference"),
    ("skipped", "skipped"),
    ("na", "not applicable"),
    ("env_broken", "environment-broken"),
)
FRAMEWORK_LABELS = {"torch": "torch (control)", "rrpc": "rrpc"}


def format_totals(summary: dict[str, Any], frameworks: Iterable[str]) -> str:
    """The totals as the README's Markdown table: a row per suite and framework,
    all suites last. An empty cell is a zero."""
    frameworks = tuple(frameworks)
    lines = [
        "| suite | framework | " + " | ".join(heading for _, heading in COLUMNS) + " |",
        "|---|---|" + "---|" * len(COLUMNS),
    ]
    for suite, by_framework in summary.items():
        label = "all suites" if suite == "ALL" else suite
        for framework in frameworks:
            counts = by_framework.get(framework, {})
            cells = [str(counts[key]) if counts.get(key) else "" for key, _ in COLUMNS]
            row = [label, FRAMEWORK_LABELS.get(framework, framework), *cells]
            lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def unexpected_failures(entries: list[dict[str, Any]], frameworks: Iterable[str]) -> list[str]:
    """The tests that make the run fail: on rrpc, each failure that is neither
    a known difference nor environment-broken; on torch run alone, each failure."""
    frameworks = tuple(frameworks)
    failed = ("fail", "timeout", "error")
    found = []
    for entry in entries:
        if entry.get("na"):
            continue
        if "rrpc" in frameworks:
            result = entry.get("rrpc")
            if (
                result
                and result["outcome"] in failed
                and not entry.get("known_difference")
                and not entry.get("env_broken")
            ):
                found.append(f"{entry['test']} (rrpc: {result['outcome']}: {result['short']})")
        elif entry.get("torch", {}).get("outcome") in failed:
            found.append(f"{entry['test']} (torch: {entry['torch']['outcome']})")
    return found


def _cell(entry: dict[str, Any], framework: str) -> str:
    if entry.get("na"):
        return "n/a"
    result = entry.get(framework)
    if result is None:
        return "-"
    return result["outcome"].upper()


def select_tests(
    listing: dict[str, str], suites: list[str] | None, patterns: list[str] | None
) -> list[str]:
    chosen = []
    for test, suite in listing.items():
        if suites and suite not in suites:
            continue
        if patterns and not any(
            fnmatch.fnmatchcase(test, p) if any(ch in p for ch in "*?[") else p in test
            for p in patterns
        ):
            continue
        chosen.append(test)
    return chosen


def run(
    tests: list[str] | None = None,
    suites: list[str] | None = None,
    patterns: list[str] | None = None,
    frameworks: tuple[str, ...] = FRAMEWORKS,
    out: Path | None = None,
    include_na: bool = False,
    timeout: float | None = None,
    verbose: bool = True,
) -> dict[str, Any]:
    """Run the selected tests on ``frameworks``; return (and write to ``out``) the results."""
    out = out or OUT / "results.json"
    log_root = out.parent / "logs"
    started = time.time()
    group = Frameworks(frameworks, log_root)
    try:
        listing = group.list_tests()
        if tests is not None:
            unknown = [test for test in tests if test not in listing]
            if unknown:
                raise KeyError(f"unknown tests: {unknown}")
            chosen = list(tests)
        else:
            chosen = select_tests(listing, suites, patterns)
        entries: list[dict[str, Any]] = []
        for number, test in enumerate(chosen, 1):
            entry: dict[str, Any] = {"test": test, "suite": listing[test]}
            reason = not_applicable_reason(test)
            if reason:
                entry["na"] = reason
            if not reason or include_na:
                limit = timeout or timeout_for(test)
                for framework in frameworks:
                    if reason and framework == "rrpc":
                        continue
                    entry[framework] = group.run(framework, test, limit)
                    entry[framework]["short"] = short_reason(entry[framework])
            classify(entry)
            entries.append(entry)
            if verbose:
                _print_entry(number, len(chosen), entry, frameworks)
            _write(out, started, frameworks, entries)
        return _write(out, started, frameworks, entries)
    finally:
        group.close()


def _print_entry(number: int, total: int, entry: dict[str, Any], frameworks: Iterable[str]) -> None:
    cells = "  ".join(f"{fw}={_cell(entry, fw):<8}" for fw in frameworks)
    durations = "/".join(
        f"{entry[fw]['duration']:.1f}s"
        for fw in frameworks
        if fw in entry and "duration" in entry[fw]
    )
    note = entry["na"][:60] if entry.get("na") else ""
    for fw in frameworks:
        if fw in entry and entry[fw]["outcome"] != "pass" and not note:
            note = f"{fw}: {entry[fw]['short'][:150]}"
    if entry.get("env_broken"):
        note = "ENV-BROKEN " + note
    elif entry.get("known_difference"):
        note = "KNOWN DIFFERENCE: " + entry["known_difference"][:100]
    elif entry["test"] in KNOWN_DIFFERENCES and entry.get("rrpc", {}).get("outcome") == "pass":
        note = "a known difference that passes: take it out of known_differences.py"
    print(f"[{number}/{total}] {entry['test']:<70} {cells} {durations:<12} {note}", flush=True)


def _write(
    out: Path, started: float, frameworks: Iterable[str], entries: list[dict[str, Any]]
) -> dict[str, Any]:
    frameworks = tuple(frameworks)
    document = {
        "meta": {
            "torch": importlib.metadata.version("torch"),
            "frameworks": list(frameworks),
            "started": time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(started)),
            "elapsed_s": round(time.time() - started, 1),
        },
        "totals": totals(entries, frameworks),
        "results": entries,
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps(document, indent=1))
    tmp.replace(out)
    return document


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m conformance", description=__doc__)
    parser.add_argument("--suite", action="append", choices=sorted(SUITES), help="repeatable")
    parser.add_argument(
        "-k", dest="patterns", action="append", help="substring or glob of Class.test (repeatable)"
    )
    parser.add_argument("--framework", choices=("rrpc", "torch", "both"), default="both")
    parser.add_argument("--subset", action="store_true", help="only the `make test` subset")
    parser.add_argument(
        "--include-na", action="store_true", help="run not-applicable tests on torch"
    )
    parser.add_argument("--timeout", type=float, help="per-test timeout (default: per test)")
    parser.add_argument("--out", type=Path, default=OUT / "results.json")
    parser.add_argument("--list", action="store_true", help="list the selected tests and exit")
    args = parser.parse_args(argv)
    frameworks = FRAMEWORKS if args.framework == "both" else (args.framework,)
    tests = None
    if args.subset:
        from conformance.subset import SUBSET

        tests = list(SUBSET)
    if args.list:
        group = Frameworks(("torch",), args.out.parent / "logs")
        try:
            listing = group.list_tests()
        finally:
            group.close()
        chosen = tests if tests is not None else select_tests(listing, args.suite, args.patterns)
        for test in chosen:
            reason = not_applicable_reason(test)
            print(f"{listing[test]:<16}{test:<75}{'n/a: ' + reason if reason else ''}")
        return 0
    document = run(
        tests=tests,
        suites=args.suite,
        patterns=args.patterns,
        frameworks=frameworks,
        out=args.out,
        include_na=args.include_na,
        timeout=args.timeout,
    )
    print()
    print(format_totals(document["totals"], frameworks))
    print(f"\nresults: {args.out}  ({document['meta']['elapsed_s']:.0f} s)")
    failures = unexpected_failures(document["results"], frameworks)
    if failures:
        print(f"\n{len(failures)} test(s) failed that are no known difference:")
        for failure in failures:
            print(f"  {failure}")
        return 1
    return 0
