"""From a Skeleton, Hardware and Workload to a Plan: inputs, sizing, strategies, solve, cost model, advice."""
