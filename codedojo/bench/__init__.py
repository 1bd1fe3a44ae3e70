"""dojobench: task format, versioned suites, a task builder from real packages, the runner and
its reports."""
