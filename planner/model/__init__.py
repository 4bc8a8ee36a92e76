"""The model as the planner sees it: Skeleton builders, config values, checkpoint keys and headers, model references."""
