"""Lowering: strategies of each op, redistribution programs, the cost model, gradient buckets,
stage-boundary programs — pure functions both the planner and the runtime read."""
