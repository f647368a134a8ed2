"""Thin Prefect @task wrappers over diagnosis and tuning (logic: tasks/diagnose.py, tasks/tune.py)."""

from __future__ import annotations

from collections.abc import Sequence

from prefect import task
from prefect.cache_policies import NONE

from rollflow.tasks.collect.plan import RunPlan
from rollflow.tasks.collect.rollouts import CollectContext
from rollflow.tasks.tuning.diagnose import Diagnosis, diagnose
from rollflow.tasks.tuning.probe import ProbeFeed, StepResult
from rollflow.tasks.tuning.tune import TuneOptions, Tuning, tune


@task(name="diagnose-bottleneck", cache_policy=NONE)
async def diagnose_task(
    ctx: CollectContext, plan: RunPlan, low: int, high: int, rows: int, feed: ProbeFeed
) -> Diagnosis:
    return await diagnose(ctx, plan, low=low, high=high, rows=rows, feed=feed)


@task(name="tune-parallelism", cache_policy=NONE)
async def tune_task(
    ctx: CollectContext, plan: RunPlan, options: TuneOptions, feed: ProbeFeed, seeds: Sequence[StepResult]
) -> Tuning:
    return await tune(ctx, plan, options, feed=feed, seeds=seeds)
