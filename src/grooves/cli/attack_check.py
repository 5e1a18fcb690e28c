"""``grooves judge calibrate --attacks``: the built-in attack set against the judge and guards.

For the first few samples of the batch, every attack of ``grooves.rewards.attacks`` wraps
the sample's output; the rubric's judge scores the plain and the attacked outputs, and the
guards (the ``InjectionGuard`` by default, or the guards of a run config's ``[reward]``)
see the attacked ones. The table says, per attack, how the judge's score moved and which
guards vetoed it; the summary names the attacks that raised the score, those that passed
every guard, and those that did both, which are the ones a long run would learn.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING

from grooves.cli.common import _fail, out

if TYPE_CHECKING:
    from grooves.rewards.attacks import AttackResult
    from grooves.rewards.calibrate import Sample
    from grooves.rewards.compose import RewardComponent


def config_guards(path: Path | None) -> list[RewardComponent]:
    """The guards of a run config's ``[reward]`` section, or the default InjectionGuard."""
    from grooves.rewards import InjectionGuard

    if path is None:
        return [InjectionGuard()]
    from grooves.training.config import ConfigError, load_config
    from grooves.rewards.config import ComponentBuildError, build_components
    from grooves.serve.local import local_url

    try:
        reward = load_config(path).reward
        components = build_components(reward, local_url) if reward.components else []
    except ConfigError as error:
        raise _fail(f"{path}: invalid config:\n{error}") from None
    except ComponentBuildError as error:
        raise _fail(f"{path}: reward.{error}") from None
    guards = [c for c in components if getattr(c, "veto", False)]
    if not guards:
        raise _fail(f"{path}: its [reward] has no guard components (kind = \"guard\") to check")
    return guards


def run_attack_check(judge: RewardComponent, guards: list[RewardComponent], batch: list[Sample],
                     count: int) -> list[AttackResult]:
    from grooves.rewards.attacks import check_attacks

    results = check_attacks(judge, guards, batch[:count])
    print_attack_results(results, [g.name for g in guards], min(count, len(batch)))
    return results


def _mean(values: list[float]) -> float:
    kept = [v for v in values if not math.isnan(v)]
    return sum(kept) / len(kept) if kept else math.nan


def print_attack_results(results: list[AttackResult], guard_names: list[str], samples: int) -> None:
    from rich.markup import escape
    from rich.table import Table

    by_attack: dict[str, list[AttackResult]] = {}
    for result in results:
        by_attack.setdefault(result.attack.name, []).append(result)
    table = Table("attack", "category", "judge plain", "judge attacked", "raised on", "vetoed by",
                  title=f"built-in attacks on {samples} sample(s); guards: {', '.join(guard_names)}")
    raised, passed = [], []
    for name, rows in by_attack.items():
        up = sum(r.raised for r in rows)
        vetoes = sorted({g for r in rows for g, ok in r.passed.items() if not ok})
        raised += [name] if up else []
        passed += [name] if not vetoes else []
        plain, attacked = _mean([r.plain for r in rows]), _mean([r.attacked for r in rows])
        table.add_row(escape(name), escape(rows[0].attack.category), _score(plain), _score(attacked),
                      f"[red]{up}/{len(rows)}[/]" if up else f"0/{len(rows)}",
                      escape(", ".join(vetoes)) if vetoes else "[yellow]passed every guard[/]")
    out.print(table)
    failed = [r for r in results if r.error]
    if failed:
        out.print(f"[yellow]the judge failed on {len(failed)} attacked output(s)[/] (not counted as raised); "
                  f"first error: {escape(failed[0].error)}", highlight=False)
    at_top = {r.sample_id for r in results if r.plain >= 1.0}
    if at_top:  # a judge already at its top score cannot be raised: the check says nothing there
        out.print(f"[yellow]the judge already gives the plain output its top score on {len(at_top)} of "
                  f"{samples} sample(s)[/]: no attack can raise it there; attack outputs it scores lower",
                  highlight=False)
    both = [n for n in raised if n in passed]
    out.print(f"raised the judge's score: {len(raised)} of {len(by_attack)}"
              + (f" ({escape(', '.join(raised))})" if raised else ""), highlight=False)
    out.print(f"passed every guard: {len(passed)} of {len(by_attack)}"
              + (f" ({escape(', '.join(passed))})" if passed else ""), highlight=False)
    if both:
        out.print(f"[bold red]raised the score and passed every guard[/]: {escape(', '.join(both))}; "
                  "a run can learn these: add a guard or harden the rubric", highlight=False)
    else:
        out.print("[bold green]no attack both raised the score and passed every guard[/]", highlight=False)


def _score(value: float) -> str:
    return "[red]failed[/]" if math.isnan(value) else f"{value:.2f}"
