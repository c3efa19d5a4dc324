"""The one harness every benchmark runs on: contenders measured interleaved in rounds, one ``Sample`` type, medians and
paired ratios against the floor, Markdown tables, the command line and the run's record.

A benchmark states its scenario and its contenders, nothing else:

* ``Contender(name, op, refs={"floor": "<the floor's name>"}, info={...})``: ``op`` is one operation (an acquire +
  release, one call of a path, one worker run), ``refs`` the contenders it is compared with in the same round
  (label -> name), ``info`` what its table needs (kind, nodes, pool, ...);
* how one contender is measured in one round, ``measure(contender, round) -> Sample``: ``timed(op, seconds, max)``
  (a time slice), ``counted(op, calls)`` (a fixed count) or a whole run whose figures the script puts in
  ``Sample.values`` (real workers);

then ``interleave(contenders, rounds, measure)`` runs every contender once per round, round-robin, the first one
rotating each round (so each comes first, last, before and after each other in turn: slow drifts of a shared
machine fall on all alike), and returns ``Results``: ``median`` / ``spread`` over rounds, ``pooled`` percentiles over
every operation, ``paired`` (the median of per-round ratios or differences against a reference measured in the same
round: the figure that cancels drift). ``markdown`` prints a table, ``Cli`` parses the shared options (``--quick``,
``--json``, ``--pin``), ``start`` prints the machine and the code, ``save`` writes the record.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import _common  # benchmarks/_common.py: run as `python benchmarks/<script>.py`


@dataclass
class Contender:
    """One thing measured: ``op`` does one operation; ``refs`` names, by label, the contenders it is compared with."""

    name: str
    op: Callable[..., Any] = field(repr=False)
    refs: dict[str, str] = field(default_factory=dict)
    info: dict[str, Any] = field(default_factory=dict)

    def __getitem__(self, key: str) -> Any:
        return self.info[key]


@dataclass
class Sample:
    """One contender's measurement in one round: ``ops`` operations in ``seconds``, and the figures per operation
    (``values``: ``p50_us``, ``cpu_us``, ... for the timing loops, a script's own for a worker run)."""

    contender: str = ""
    round: int = -1
    ops: int = 0
    seconds: float = 0.0
    values: dict[str, Any] = field(default_factory=dict)
    walls_ns: list[int] = field(default_factory=list, repr=False)  # every operation's wall time, when timed here

    def __getitem__(self, name: str) -> Any:
        return self.values[name]

    def record(self) -> dict[str, Any]:
        return {"contender": self.contender, "round": self.round, "ops": self.ops, "seconds": self.seconds,
                "values": self.values}  # fmt: skip


# --- timing loops ---------------------------------------------------------------------------------------------------


def _server_cpu(pids: Sequence[int]) -> float:
    return sum(_common.process_cpu_seconds(p) for p in pids)


def _timed_sample(walls: list[int], elapsed: float, cpu: _common.CpuStamp, server: float | None) -> Sample:
    count = len(walls)
    per = 1e6 / max(count, 1)
    ordered = sorted(walls)
    values = {
        "ops_per_s": count / elapsed if elapsed else 0.0,
        "p50_us": _common.percentile(ordered, 0.50) / 1000,
        "p99_us": _common.percentile(ordered, 0.99) / 1000,
        "mean_us": elapsed * per,
        "cpu_us": cpu.cpu * per,  # this process, all threads
        "user_s": cpu.user,  # getrusage totals (tick-sampled split: only meaningful summed over many samples)
        "system_s": cpu.system,
    }
    if server is not None:
        values["server_cpu_us"] = server * per  # the redis-servers' main threads
    return Sample(ops=count, seconds=elapsed, values=values, walls_ns=walls)


def timed(
    op: Callable[[], Any], seconds: float, max_ops: int, *, server_pids: Sequence[int] = (), collect: bool = False
) -> Sample:
    """Run ``op()`` until ``seconds`` pass or ``max_ops`` ran (``collect``: ``gc.collect()`` first). Each operation's
    wall time runs from the end of the one before; CPU of this process and of ``server_pids`` around the loop."""
    if collect:
        gc.collect()
    clock = time.perf_counter_ns
    walls: list[int] = []
    append = walls.append
    server0 = _server_cpu(server_pids)
    cpu0 = _common.CpuStamp.now()
    start = clock()
    deadline = start + int(seconds * 1e9)
    now = start
    count = 0
    while count < max_ops and now < deadline:
        op()
        end = clock()
        append(end - now)
        now = end
        count += 1
    cpu = _common.CpuStamp.now() - cpu0
    server = _server_cpu(server_pids) - server0 if server_pids else None
    return _timed_sample(walls, (now - start) / 1e9, cpu, server)


def counted(op: Callable[[int], Any], calls: int, *, server_pids: Sequence[int] = ()) -> Sample:
    """Run ``op(i)`` for i in ``range(calls)``; the same figures as ``timed``."""
    clock = time.perf_counter_ns
    walls: list[int] = []
    append = walls.append
    server0 = _server_cpu(server_pids)
    cpu0 = _common.CpuStamp.now()
    start = now = clock()
    for i in range(calls):
        op(i)
        end = clock()
        append(end - now)
        now = end
    cpu = _common.CpuStamp.now() - cpu0
    server = _server_cpu(server_pids) - server0 if server_pids else None
    return _timed_sample(walls, (now - start) / 1e9, cpu, server)


# --- rounds ---------------------------------------------------------------------------------------------------------


def rotated(items: Sequence[Any], rnd: int) -> list[Any]:
    """``items`` rotated by ``rnd``: round ``rnd``'s order."""
    shift = rnd % len(items) if items else 0
    return list(items[shift:]) + list(items[:shift])


class Results:
    """Every contender's samples (one per round it did not fail) and failures, and the figures drawn from them."""

    def __init__(self, contenders: Iterable[Contender]) -> None:
        self.contenders = list(contenders)
        self.samples: dict[str, list[Sample]] = {c.name: [] for c in self.contenders}
        self.failures: dict[str, list[str]] = {c.name: [] for c in self.contenders}

    def __getitem__(self, name: str) -> list[Sample]:
        return self.samples[name]

    def values(self, name: str, metric: str | Callable[[Sample], float]) -> list[float]:
        get = metric if callable(metric) else (lambda s: s.values[metric])
        return [float(get(s)) for s in self.samples[name]]

    def median(self, name: str, metric: str | Callable[[Sample], float]) -> float:
        values = self.values(name, metric)
        return statistics.median(values) if values else float("nan")

    def spread(self, name: str, metric: str | Callable[[Sample], float]) -> tuple[float, float]:
        values = self.values(name, metric) or [float("nan")]
        return min(values), max(values)

    def total(self, name: str, metric: str) -> float:
        return sum(self.values(name, metric))

    def pooled(self, name: str, q: float) -> float:
        """Percentile ``q`` of every operation's wall time over all rounds, µs."""
        walls = sorted(w for s in self.samples[name] for w in s.walls_ns)
        return _common.percentile(walls, q) / 1000

    def paired(self, name: str, ref: str, metric: str | Callable[[Sample], float], *, delta: bool = False) -> float:
        """Median over the rounds both were measured in of ``name``'s figure / ``ref``'s (``delta``: minus)."""
        get = metric if callable(metric) else (lambda s: s.values[metric])
        theirs = {s.round: s for s in self.samples[ref]}
        pairs = [(float(get(s)), float(get(theirs[s.round]))) for s in self.samples[name] if s.round in theirs]
        if not pairs:
            return float("nan")
        return statistics.median(a - b if delta else a / b for a, b in pairs)

    def across(self, f: Callable[[dict[str, Sample]], float]) -> float:
        """Median over rounds of ``f`` of one round's samples (by contender name; rounds every contender made)."""
        rounds: dict[int, dict[str, Sample]] = {}
        for name, samples in self.samples.items():
            for s in samples:
                rounds.setdefault(s.round, {})[name] = s
        full = [r for r in rounds.values() if len(r) == len(self.samples)]
        return statistics.median(f(r) for r in full)

    def record(self) -> dict[str, Any]:
        return {
            name: {"samples": [s.record() for s in samples], "failures": self.failures[name]}
            for name, samples in self.samples.items()
        }


def interleave(
    contenders: Sequence[Contender],
    rounds: int,
    measure: Callable[[Contender, int], Sample],
    *,
    warmup: Callable[[Contender], Any] | None = None,
    collect: bool = False,
    catch: tuple[type[BaseException], ...] = (),
    on_sample: Callable[[Sample], Any] | None = None,
    on_round: Callable[[int, Results], Any] | None = None,
) -> Results:
    """Warm every contender up once (``warmup``), then ``rounds`` rounds, each measuring every contender once in
    ``rotated`` order (``collect``: ``gc.collect()`` before each round). A ``catch`` exception is the contender's
    failure in that round (said on stderr), not the run's."""
    results = Results(contenders)
    if warmup is not None:
        for c in contenders:
            warmup(c)
    for rnd in range(rounds):
        if collect:
            gc.collect()
        for c in rotated(contenders, rnd):
            try:
                sample = measure(c, rnd)
            except catch as exc:
                results.failures[c.name].append(str(exc))
                print(f"# round {rnd + 1} {c.name}: FAILED {exc}", file=sys.stderr)
                continue
            sample.contender, sample.round = c.name, rnd
            results.samples[c.name].append(sample)
            if on_sample is not None:
                on_sample(sample)
        if on_round is not None:
            on_round(rnd, results)
    return results


def every(n: int, rounds: int, say: Callable[[int, Results], str]) -> Callable[[int, Results], None]:
    """An ``on_round`` that prints ``say(round, results)`` to stderr every ``n`` rounds and after the last."""
    started = time.perf_counter()

    def on_round(rnd: int, results: Results) -> None:
        if (rnd + 1) % n == 0 or rnd + 1 == rounds:
            print(f"# round {rnd + 1}/{rounds}, {time.perf_counter() - started:.0f} s{say(rnd, results)}",
                  file=sys.stderr)  # fmt: skip

    return on_round


# --- output ---------------------------------------------------------------------------------------------------------


def markdown(header: Sequence[str], rows: Iterable[Sequence[str]], align: str = "") -> str:
    """A Markdown table; ``align`` one letter per column, ``l`` or ``r`` (default: the first left, the rest right)."""
    align = align or "l" + "r" * (len(header) - 1)
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---:" if a == "r" else "---" for a in align) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def ratio_text(values: list[float]) -> str:
    """``median x (min-max)``."""
    return f"{statistics.median(values):.2f}x ({min(values):.2f}-{max(values):.2f})" if values else "-"


class Cli(argparse.ArgumentParser):
    """The benchmark's options, plus the shared ones: ``--quick`` (the settings in ``quick``: a few seconds, to prove
    the script runs; its figures mean nothing), ``--json PATH`` and, given a default, ``--pin``."""

    def __init__(self, doc: str, *, quick: dict[str, Any], pin: str | None = None, pin_help: str = "") -> None:
        super().__init__(description=doc.split("\n\n", maxsplit=1)[0])
        self.quick = quick
        settings = " ".join(f"--{k.replace('_', '-')} {v}" for k, v in quick.items() if v is not True)
        flags = " ".join(f"--{k.replace('_', '-')}" for k, v in quick.items() if v is True)
        self.add_argument("--quick", action="store_true", help=f"a smoke run in seconds: {settings} {flags}".strip())
        self.add_argument("--json", metavar="PATH", help="also write the environment, the samples and the summary")
        if pin is not None:
            self.add_argument("--pin", choices=_common.PIN_MODES, default=pin, help=_common.PIN_HELP + pin_help)

    def parse(self, argv: list[str] | None = None) -> argparse.Namespace:
        args = self.parse_args(argv)
        if args.quick:
            for key, value in self.quick.items():
                setattr(args, key, value)
        return args


def start(title: str, *dists: str) -> dict[str, Any]:
    """The machine, the software (``dists``' versions too) and the code, printed to stderr as the run's header."""
    env = _common.environment(*dists)
    print(f"# {title}, {env['date_utc']}", file=sys.stderr)
    print(f"# {json.dumps(env)}", file=sys.stderr)
    print(f"# argv: {' '.join(sys.argv)}", file=sys.stderr)
    return env


def save(args: argparse.Namespace, env: dict[str, Any], **results: Any) -> None:
    """With ``--json``: the run's record (environment, command line, arguments, then ``results``)."""
    if args.json:
        _common.write_json(args.json, env, args, **results)
