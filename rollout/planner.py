from rollout.plan.planner import *  # noqa: F401,F403  (the old import path: ``rollout.planner.CostModel``)
