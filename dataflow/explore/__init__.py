"""Design-space exploration: sweep designs x serving workloads through the cost models into a durable store.

    space   a base design, parameters to vary and constraints, from YAML (spaces/*.yaml)
    search  grid, random and Optuna-TPE strategies
    eval    one (design point, workload): step cost, serving simulation, capacity, area
    engine  strategy -> inline / process-pool / Ray evaluation -> store, resumable
    store   the SQLite result store, keyed by point, workload and code version
    report  Pareto fronts, breakdowns and matched-pair findings (HTML + PNG)
    cli     `codesign explore`
"""
