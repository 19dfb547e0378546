"""An experiment's headline figures, defined in code: the metric, the paper's arm, the strongest
baseline measured in the same run (chosen by a rule the summary records), the spread, the target
and whether it is met.

Every experiment's config module names a builder (``HEADLINES = "package.module:function"``,
read by :class:`jaxflow.config.ExperimentSpec`); the runner calls it on the finished summary and
stores ``summary["headlines"]``: a list of :meth:`Headline.to_json` dicts
(``jaxflow.study.report.with_headlines``). A builder is a plain function ``summary -> list of
Headline`` that reads only the summary's own keys, so it can be tested on a synthetic summary and
re-run on an old run directory.

The rule for the baseline: the best figure among the baselines measured in that run
(:func:`strongest_baseline`); a paper arm is never compared to a baseline it did not run beside.
Ratio headlines are oriented so that more is better (``algorithm / baseline`` for a rate,
``baseline / algorithm`` for a time); difference headlines likewise (``algorithm - baseline``).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from jaxflow.study.intervals import paired_by_seed, seed_interval

__all__ = ["Headline", "Spread", "HeadlineBuilder", "strongest_baseline", "headline_from_arms",
           "seed_spread", "range_spread", "met", "mark_stale", "finite_arms", "paper_check", "paper_check_line",
           "headline_from_ratios"]

#: ``summary -> [Headline, ...]``: what a config module's ``HEADLINES`` names.
HeadlineBuilder = Callable[[Mapping[str, Any]], "list[Headline]"]

SPREAD_KINDS = ("seeds", "rounds", "pairs")
COMPARES = ("ratio", "difference", "value")


@dataclasses.dataclass(frozen=True)
class Spread:
    """The spread of a headline figure: ``n`` seeds / timing rounds / alternated pairs and the
    interval ``[low, high]`` of the headline's own unit; ``interval`` says what it is (e.g.
    ``"95% t-interval over paired seeds"``, ``"range of alternated pairs"``)."""

    kind: str
    n: int
    low: float
    high: float
    interval: str

    def __post_init__(self):
        if self.kind not in SPREAD_KINDS:
            raise ValueError(f"spread kind={self.kind!r}; valid: {', '.join(SPREAD_KINDS)}")

    def to_json(self) -> dict:
        """The contract's ``spread`` dict."""
        return {"kind": self.kind, "n": int(self.n), "low": float(self.low), "high": float(self.high),
                "interval": self.interval}


@dataclasses.dataclass(frozen=True)
class Headline:
    """One headline figure of a run (the ``summary["headlines"]`` entry, :meth:`to_json`).

    Attributes:
      name: a stable id (``"throughput_vs_strongest"``).
      metric: what is measured, in words (``"training samples/s ratio"``).
      algorithm: the paper's arm (``"nestpipe dbp+fwp"``).
      baseline: the strongest baseline of the same run, or None (a figure with no baseline).
      baseline_rule: how ``baseline`` was chosen, with the arms it was chosen from.
      baselines: every baseline measured in the run, ``{arm: raw figure}`` (the arm's unit).
      value: the headline figure (ratio / difference / value, oriented by ``higher_is_better``).
      unit: ``"x"``, ``"accuracy"``, ...
      higher_is_better: whether a larger ``value`` is better.
      spread: the figure's :class:`Spread`, or None (one measurement).
      target, target_text: the paper's target for ``value`` (None: no target) and its words.
      met: ``value`` against ``target`` (None without a target).
      stale: True when the figure comes from a calibration whose measured code changed since it
        was measured (the simulators); None when not applicable.
      note: said after the figure in :meth:`line` (the stale warning, a caveat).
    """

    name: str
    metric: str
    algorithm: str
    baseline: str | None
    baseline_rule: str
    baselines: Mapping[str, float]
    value: float
    unit: str
    higher_is_better: bool = True
    spread: Spread | None = None
    target: float | None = None
    target_text: str = ""
    met: bool | None = None
    stale: bool | None = None
    note: str = ""

    def to_json(self) -> dict:
        """The contract's dict (JSON types; non-finite numbers as None)."""
        return {"name": self.name, "metric": self.metric, "algorithm": self.algorithm,
                "baseline": self.baseline, "baseline_rule": self.baseline_rule,
                "baselines": {str(k): _num(v) for k, v in self.baselines.items()},
                "value": _num(self.value), "unit": self.unit, "higher_is_better": bool(self.higher_is_better),
                "spread": None if self.spread is None else self.spread.to_json(),
                "target": None if self.target is None else float(self.target), "target_text": self.target_text,
                "met": self.met, "stale": self.stale, "note": self.note}

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> "Headline":
        """The :class:`Headline` of a contract dict (:meth:`to_json`'s, or one a driver wrote
        in that shape); KeyError names a missing key."""
        spread = d.get("spread")
        return cls(name=d["name"], metric=d["metric"], algorithm=d["algorithm"], baseline=d["baseline"],
                   baseline_rule=d["baseline_rule"], baselines=dict(d["baselines"]),
                   value=math.nan if d["value"] is None else float(d["value"]), unit=d["unit"],
                   higher_is_better=bool(d["higher_is_better"]),
                   spread=None if spread is None else Spread(spread["kind"], int(spread["n"]), float(spread["low"]),
                                                             float(spread["high"]), spread["interval"]),
                   target=d.get("target"), target_text=d.get("target_text", ""), met=d.get("met"),
                   stale=d.get("stale"), note=d.get("note", ""))

    def line(self) -> str:
        """One readable line: figure, baseline, spread, target and the note."""
        unit = "x" if self.unit == "x" else f" {self.unit}"
        text = f"{self.name}: {self.algorithm} {self.value:.4g}{unit}"
        if self.baseline is not None:
            text += f" vs {self.baseline} ({self.baseline_rule})"
        if self.spread is not None:
            text += f", {self.spread.interval} [{self.spread.low:.4g}, {self.spread.high:.4g}] (n={self.spread.n})"
        if self.target is not None:
            text += f"; target {self.target_text or self.target}: {'met' if self.met else 'not met'}"
        return text + (f" {self.note}" if self.note else "")


def _num(value: Any) -> float | None:
    v = float(value)
    return v if math.isfinite(v) else None


def finite_arms(arms: Mapping[str, Any], names: Sequence[str] | None = None) -> dict[str, float]:
    """``{arm: float(value)}`` of the arms (all, or ``names`` in that order) whose value is a
    finite number; the others (absent, None, NaN, a string) are left out."""
    out = {}
    for name in (arms if names is None else names):
        v = arms.get(name)
        if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
            out[name] = float(v)
    return out


def strongest_baseline(baselines: Mapping[str, float], higher_is_better: bool) -> tuple[str, str]:
    """(arm, rule): the best of ``baselines`` (``{arm: figure}``, the ones measured in this run;
    the largest figure when ``higher_is_better``, else the smallest; ties go to the first) and
    the rule's text naming every arm it was chosen from. ValueError when none is finite."""
    finite = finite_arms(baselines)
    if not finite:
        raise ValueError(f"strongest_baseline: no finite baseline figure in {dict(baselines)!r}; "
                         "valid: at least one arm with a finite number")
    pick = max if higher_is_better else min
    best = pick(finite, key=lambda k: finite[k])
    word = "highest" if higher_is_better else "lowest"
    return best, f"best ({word} figure) of the baselines measured in this run: {', '.join(finite)}"


def met(value: float, target: float | None, higher_is_better: bool = True) -> bool | None:
    """Whether ``value`` meets ``target`` (``>=`` when higher is better, else ``<=``); None
    without a target or with a non-finite value."""
    if target is None or not math.isfinite(value):
        return None
    return bool(value >= target) if higher_is_better else bool(value <= target)


def _compare(arm: float, base: float, compare: str, higher_is_better: bool) -> float:
    if compare == "ratio":
        if (base if higher_is_better else arm) == 0:
            return math.nan
        return arm / base if higher_is_better else base / arm
    if compare == "difference":
        return arm - base if higher_is_better else base - arm
    return arm


def headline_from_arms(name: str, metric: str, algorithm: str, arms: Mapping[str, Any], *,
                       baselines: Sequence[str], higher_is_better: bool = True, compare: str = "ratio",
                       unit: str | None = None, target: float | None = None, target_text: str = "",
                       arm: str | None = None, per_seed: Mapping[str, Mapping[Any, float]] | None = None,
                       rounds: Mapping[str, Sequence[float]] | None = None, rounds_kind: str = "rounds",
                       note: str = "") -> Headline:
    """A headline from the arms' raw figures: ``arm`` (default ``algorithm``) against the
    strongest of ``baselines`` present in ``arms`` (:func:`strongest_baseline`).

    Args:
      arms: ``{arm: raw figure}`` (samples/s, accuracy, seconds, ...), one per arm of the run.
      baselines: the baseline arms to choose from (those missing or non-finite in ``arms`` are
        not measured in this run and are left out); empty: a plain value headline.
      higher_is_better: of the raw figure (False for times and losses).
      compare: ``"ratio"`` (value = arm / baseline, or baseline / arm for a time: > 1 is
        better; unit ``"x"``), ``"difference"`` (arm - baseline, sign oriented likewise) or
        ``"value"`` (the arm's raw figure).
      per_seed: ``{arm: {seed: figure}}``: the spread is the 95% t-interval of the per-seed
        comparison over the seeds the arm and the baseline share (:func:`seed_spread`).
      rounds: ``{arm: [raw figure per round]}`` (timing rounds or alternated pairs, the same
        rounds for every arm): the spread is the range over rounds of the round's comparison
        with the chosen baseline's figure of that round (:func:`range_spread`), or of the arm's
        own figures for a ``"value"`` headline; ``rounds_kind`` names them.
    Returns a :class:`Headline`; its ``higher_is_better`` is the raw figure's for ``"value"``
    and True otherwise. ValueError (one line) for a bad ``compare`` or a missing arm.
    """
    if compare not in COMPARES:
        raise ValueError(f"compare={compare!r}; valid: {', '.join(COMPARES)}")
    arm = arm or algorithm
    own = finite_arms(arms, [arm])
    if arm not in own:
        raise ValueError(f"headline {name!r}: arm {arm!r} has no finite figure; arms: {sorted(arms)}")
    base_figures = finite_arms(arms, [b for b in baselines if b != arm])
    base, rule = (strongest_baseline(base_figures, higher_is_better) if base_figures and compare != "value"
                  else (None, "no baseline: the arm's own figure"))
    value = own[arm] if base is None else _compare(own[arm], base_figures[base], compare, higher_is_better)
    oriented = higher_is_better if base is None else True
    spread = None
    if per_seed is not None and base is not None and arm in per_seed and base in per_seed:
        spread = seed_spread(per_seed[arm], per_seed[base], compare=compare, higher_is_better=higher_is_better)
    elif rounds is not None and rounds.get(arm):
        own_rounds = rounds[arm]
        if base is not None:  # the comparison round by round (rounds the baseline also has)
            base_rounds = rounds.get(base) or ()
            own_rounds = [_compare(float(a), float(b), compare, higher_is_better)
                          for a, b in zip(own_rounds, base_rounds)]
        spread = range_spread(own_rounds, kind=rounds_kind)
    unit = unit or ("x" if compare == "ratio" and base is not None else "")
    return Headline(name=name, metric=metric, algorithm=algorithm, baseline=base, baseline_rule=rule,
                    baselines=base_figures, value=value, unit=unit, higher_is_better=oriented, spread=spread,
                    target=target, target_text=target_text, met=met(value, target, oriented), note=note)


def headline_from_ratios(name: str, metric: str, algorithm: str, ratios: Mapping[str, Mapping[str, float]], *,
                         target: float | None = None, target_text: str = "", kind: str = "pairs") -> Headline:
    """A speed-up headline from speed-ups already measured against each baseline:
    ``ratios[baseline] = {"median", "min", "max", "pairs"}`` of baseline time / ``algorithm``
    time over alternated pairs (> 1: the algorithm is faster). The strongest baseline is the
    one the algorithm beats least (the fastest baseline; its ``baselines`` figure is its time
    relative to the algorithm's); the spread is that baseline's [min, max] over the pairs."""
    finite = {b: r for b, r in ratios.items() if finite_arms(r, ["median"])}
    if not finite:
        raise ValueError(f"headline {name!r}: no finite speed-up in {dict(ratios)!r}; valid: "
                         "{baseline: {'median', 'min', 'max'}}")
    base, rule = strongest_baseline({b: r["median"] for b, r in finite.items()}, higher_is_better=False)
    rule = rule.replace("best (lowest figure)", "fastest (least speed-up over it)")
    r = finite[base]
    spread = (Spread(kind, int(r.get("pairs") or 0), float(r["min"]), float(r["max"]),
                     "range of alternated pairs" if kind == "pairs" else "range of timing rounds")
              if finite_arms(r, ["min", "max"]).keys() == {"min", "max"} else None)
    value = float(r["median"])
    return Headline(name=name, metric=metric, algorithm=algorithm, baseline=base, baseline_rule=rule,
                    baselines={b: float(v["median"]) for b, v in finite.items()}, value=value, unit="x",
                    spread=spread, target=target, target_text=target_text, met=met(value, target))


def seed_spread(arm: Mapping[Any, float], base: Mapping[Any, float], *, compare: str = "difference",
                higher_is_better: bool = True, level: float = 0.95) -> Spread | None:
    """The 95% t-interval over paired seeds of the arm-vs-baseline comparison (``{seed:
    figure}`` maps; the seeds both hold): for ``"difference"`` the paired interval of
    ``arm - base`` (:func:`jaxflow.study.paired_by_seed`), for ``"ratio"`` the t-interval of the
    per-seed ratios. None with fewer than two shared seeds."""
    seeds = sorted(set(arm) & set(base))
    if len(seeds) < 2:
        return None
    text = f"{round(level * 100)}% t-interval over paired seeds"
    if compare == "difference":
        a, b = (arm, base) if higher_is_better else (base, arm)
        pi = paired_by_seed(a, b, level=level)
        return Spread("seeds", pi.n, pi.mean - pi.half_width, pi.mean + pi.half_width, text)
    per = [_compare(float(arm[s]), float(base[s]), "ratio", higher_is_better) for s in seeds]
    iv = seed_interval(per, level=level)
    return Spread("seeds", iv["n"], iv["low"], iv["high"], text)


def range_spread(values: Sequence[float], *, kind: str = "rounds") -> Spread | None:
    """The range (min, max) of ``values`` ([n] per-round or per-pair figures, non-finite ones
    left out); None when none is finite."""
    vals = [float(v) for v in values if isinstance(v, (int, float)) and math.isfinite(v)]
    if not vals:
        return None
    what = {"rounds": "range of timing rounds", "pairs": "range of alternated pairs",
            "seeds": "range over seeds"}.get(kind, kind)
    return Spread(kind, len(vals), min(vals), max(vals), what)


def mark_stale(headline: Headline, commit: str | None) -> Headline:
    """``headline`` from a stale calibration: ``stale=True`` and the line says so
    (``"(stale calibration: measured code changed since <commit>)"``)."""
    since = (commit or "an unknown commit")[:12]
    note = f"(stale calibration: measured code changed since {since})"
    return dataclasses.replace(headline, stale=True, note=(f"{headline.note} {note}".strip()))


def paper_check(paper: float, predicted: float, rel_tol: float) -> dict:
    """A simulator's prediction beside the paper's figure: ``{"paper", "predicted",
    "relative_error"`` (predicted / paper - 1), ``"rel_tol"``, ``"within_tolerance"``
    (|relative_error| <= rel_tol)``}``; reported as the error and the tolerance, not as a
    bare pass (:func:`paper_check_line`)."""
    err = float(predicted) / float(paper) - 1.0
    return {"paper": float(paper), "predicted": float(predicted), "relative_error": err,
            "rel_tol": float(rel_tol), "within_tolerance": bool(abs(err) <= rel_tol)}


def paper_check_line(name: str, check: Mapping[str, float]) -> str:
    """One log line of a :func:`paper_check`: ``"paper check NAME: predicted 3 vs paper 7.3:
    relative error -59% (tolerance +-25%)"``."""
    return (f"paper check {name}: predicted {check['predicted']:.4g} vs paper {check['paper']:.4g}: "
            f"relative error {check['relative_error']:+.0%} (tolerance +-{check['rel_tol']:.0%})")
