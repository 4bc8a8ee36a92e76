"""The ``loadmaster`` command line: serve, demo, plan, estimate, env, and the pipeline launcher."""
