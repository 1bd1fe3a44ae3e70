"""dojobench: task format, versioned suites, a task builder from real packages, the runner and
its reports.

    from codedojo.bench.suite import load_suite                  # "v1", "v0", "micro" or a folder
    from codedojo.bench.workspace import TaskImages, default_provider
    from codedojo.bench.runner import OracleAgent, HarnessAgent, run_agent
    from codedojo.bench.report import write_report

    suite = load_suite("v1")
    images = TaskImages(default_provider())                      # cached per task content
    run = run_agent(images, OracleAgent(), suite.split("test"), name="v1-oracle", parallel=4)
    write_report(run)                                            # runs/v1-oracle/report.{md,json,png}

Files: task.py (the record), suite.py (manifest, load/save), source.py (sdist cache), mutate.py
(libcst bugs), statement.py (symptom-only statements), builder.py (recipe -> suite),
testrun.py (pytest runs behind `Executor`), workspace.py (agent and grading images), runner.py,
validate.py, report.py, models.py (SmolLM2 agent), demo.py (`dojo demo`), cli.py.
"""
