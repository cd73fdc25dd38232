"""CUDA C++ sources of k4's kernels (package data: *.cu, *.cuh), compiled at run time by runtime.cuda."""
from pathlib import Path

SOURCE_DIR = Path(__file__).resolve().parent
