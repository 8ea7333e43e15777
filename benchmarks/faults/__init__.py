"""The parts of benchmarks/serve_faults.py: processes, one request, the phases, the report."""
