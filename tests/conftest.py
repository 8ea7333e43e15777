import os

# Two shared cores: torch/OpenMP spin-waiting threads make tiny-model steps 20-50x slower under load, and the
# sub-server processes each run their own pool. One thread per process keeps tests fast and timings stable.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# no detached AOT kernel builds from test processes (a fresh tmp cache would start one per process); the AOT
# module is built explicitly where a test needs it (tests/test_aot_kernels.py)
os.environ.setdefault("TOKENPLANE_AOT_BUILD", "0")
