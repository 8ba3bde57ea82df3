"""``python -m luka_bench.probe ...``: the probe's command line, which is its report's (``luka_bench.probe_report``);
the package itself is the measurement, and imports no report."""
from luka_bench.probe_report import main

main()
