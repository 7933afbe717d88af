"""Commands beside the DAG: HF conversion and the benchmarks."""
